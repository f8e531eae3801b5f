"""The dashboard in a real browser on the real default model."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from tests.browser.conftest import App, screenshot
from tests.integration.web.conftest import engine_held

PAGES = ("chat", "models", "telemetry", "roofline", "race")


def wait_ready(page: Any) -> None:
    page.wait_for_function("document.getElementById('g-state').textContent === 'ready'")


def fill_and_go(page: Any, path: str, fields: dict[str, str], button: str) -> None:
    """Open a page, wait for the engine, fill the form fields (in order) and press the button."""
    page.goto(path)
    wait_ready(page)
    for selector, value in fields.items():
        page.fill(selector, value)
    page.click(button)


def test_every_page_loads_with_the_gauge(page: Any, app: App) -> None:
    for name in PAGES:
        page.goto(f"/ui/{name}")
        wait_ready(page)
        assert page.locator("#g-model").inner_text() == "default"
        assert page.locator("#g-mode").inner_text().lower() == "mode plain"  # not "baseline" here, "plain" there
        assert page.locator(f"nav a[data-nav='{name}']").get_attribute("class") == "active"
        page.wait_for_function("document.getElementById('g-mem').textContent !== '—'")  # model memory measured
        assert page.locator("#g-mem").inner_text().endswith("MB")
        screenshot(page, f"page-{name}")


MAIN_CONTROL = {"chat": "#send", "models": "#load-go", "telemetry": "#chart-toks", "roofline": "#roof-go",
                "race": "#race-go"}  # fmt: skip


@pytest.mark.parametrize("width", [390, 768, 1280])
def test_every_page_fits_the_screen(chromium: Any, app: App, width: int) -> None:
    """No page scrolls sideways and its main control is on screen (at 390 px the chat column was 2 px wide)."""
    context = chromium.new_context(viewport={"width": width, "height": 800}, base_url=app.base_url)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        for name in PAGES:
            page.goto(f"/ui/{name}")
            wait_ready(page)
            overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 1, f"{name} at {width} px scrolls sideways by {overflow} px"
            control = page.locator(MAIN_CONTROL[name])
            box = control.bounding_box()
            assert control.is_visible() and box is not None and box["width"] > 20, (name, width, box)
            assert box["x"] >= 0 and box["x"] + box["width"] <= width, (name, width, box)
            screenshot(page, f"page-{name}-{width}")
        if width < 1100:  # chat's sessions and settings are drawers there
            page.goto("/ui/chat")
            wait_ready(page)
            prompt = page.locator("#prompt").bounding_box()
            assert prompt is not None and prompt["width"] > width * 0.5
            assert not page.locator("#temperature").is_visible()
            page.click("#toggle-settings")
            assert page.locator("#temperature").is_visible()
            page.click("#close-settings")
            page.click("#toggle-sessions")
            assert page.locator("#new-session").is_visible()
            screenshot(page, f"chat-drawer-{width}")
        assert errors == []
    finally:
        context.close()


def test_chat_streams_an_answer_and_the_session_is_found_after_a_reload(page: Any, app: App) -> None:
    fill_and_go(page, "/ui/chat", {"#max_tokens": "12", "#prompt": "Name three colours of the rainbow."}, "#send")
    reply = page.locator(".msg.assistant").last
    reply.locator(".body").wait_for()
    page.wait_for_function("document.querySelectorAll('.msg.assistant .body')[0].textContent.length > 0")
    page.wait_for_selector(".msg.assistant[data-done='1']")
    text = reply.locator(".body").inner_text()
    stats = reply.locator(".stats").inner_text()
    assert text.strip() and "tok/s" in stats and "tokens/round" in stats and "cached prompt tokens" in stats
    screenshot(page, "chat-answer")
    page.reload()
    wait_ready(page)
    item = page.locator("#session-list li", has_text="Name three colours of the rainbow.")
    item.first.wait_for()
    item.first.click()
    page.wait_for_selector(".msg.assistant")
    assert page.locator(".msg.user .body").first.inner_text().strip() == "Name three colours of the rainbow."
    assert page.locator(".msg.assistant .body").first.inner_text() == text
    screenshot(page, "chat-reloaded")


def test_a_reply_renders_as_sanitised_markdown_with_copy_buttons(page: Any, app: App) -> None:
    """The chat page used to show `**bold**` and code fences raw. The reply here is the server's stream, replayed
    by the browser (so its text is known): Markdown renders, HTML in it is sanitised, code gets a copy button."""
    reply = "Here is **bold** and code:\n\n```python\nprint('hi')\n```\n\n<img src=x onerror=\"window.pwned=1\">"
    stats = {"mode": "baseline", "completion_tokens": 30, "tok_s": 12.3456, "mean_accepted": 1.0,
             "cached_prompt_tokens": 0, "finish_reason": "length"}  # fmt: skip
    events = [{"type": "text", "text": reply[:17]}, {"type": "text", "text": reply[17:]}]
    events.append({"type": "done", "stats": stats})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    page.route(
        "**/ui/api/sessions/*/chat",
        lambda route: route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body),
    )
    fill_and_go(page, "/ui/chat", {"#prompt": "Show me."}, "#send")
    page.wait_for_selector(".msg.assistant[data-done='1']")
    answer = page.locator(".msg.assistant").last
    assert answer.locator(".body strong").inner_text() == "bold"
    assert answer.locator(".body pre code").inner_text().strip() == "print('hi')"
    assert answer.locator(".body pre .copy-code").count() == 1 and answer.locator(".copy-msg").count() == 1
    assert answer.locator(".body img").count() == 0 and page.evaluate("window.pwned") is None  # nothing fetched
    line = answer.locator(".stats").inner_text()
    assert "12.3 tok/s" in line and "12.3456" not in line and "hit the max-tokens limit" in line
    assert line.startswith("plain") and "baseline" not in line  # one name for plain decoding on every page
    assert page.locator(".msg.user .body").last.inner_text() == "Show me."  # the user's text stays plain
    screenshot(page, "chat-markdown")


def test_a_race_reads_identical(page: Any, app: App) -> None:
    prompt = "List the numbers from one to ten, separated by commas."
    fill_and_go(page, "/ui/race", {"#race-prompt": prompt, "#race-max": "12"}, "#race-go")
    verdict = page.locator("#verdict")
    verdict.wait_for()
    assert "identical" in verdict.inner_text()
    assert page.locator("#lane-baseline .out").inner_text() == page.locator("#lane-lookup .out").inner_text()
    assert page.locator("#lane-lookup .badge").inner_text() == "identical"
    # Every source is ticked by default, and the verdict opens with one line per lane.
    lines = page.locator("#verdict-lines div").all_inner_texts()
    assert [line.split()[0] for line in lines] == ["lookup", "dflash", "dspark"]
    assert all(" x plain, " not in line and "x plain, identical" in line for line in lines), lines
    # The page says how the lanes ran, and each lane's solo timing (median of the runs, min-max) shows.
    assert page.locator("#race-layout").inner_text().startswith("lanes run ")
    for lane in ("baseline", "lookup", "dflash", "dspark"):
        assert "median of 2" in page.locator(f"#lane-{lane} .timing").inner_text()
    screenshot(page, "race-verdict")


def test_the_telemetry_charts_update_live(page: Any, app: App) -> None:
    page.goto("/ui/telemetry")
    wait_ready(page)
    page.wait_for_timeout(500)  # the SSE stream is open and the replay drawn
    before = int(page.evaluate("document.body.dataset.updates || '0'"))
    points = page.evaluate("Chart.getChart('chart-toks').data.datasets[0].data.length")
    body = {"model": "default", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    r = httpx.post(app.base_url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200
    page.wait_for_function(f"+(document.body.dataset.updates || 0) > {before}")
    page.wait_for_function(f"Chart.getChart('chart-toks').data.datasets[0].data.length >= {points} + 7")
    page.wait_for_function("Chart.getChart('chart-time').data.labels.length > 0")
    # A prompt over 1024 tokens: its prefill progress is drawn; the same prompt again is a cache hit.
    long = [{"role": "user", "content": "Repeat after me: " + "one two three four five six seven eight. " * 120}]
    first = chat(app, long, 2)
    assert first["usage"]["prompt_tokens"] > 1024
    # Its bar: cached + prefilled cover the whole prompt, nothing left to prefill.
    done = "(d) => d[0].data.some((c, i) => c + d[1].data[i] > 1024 && d[1].data[i] > 0 && d[2].data[i] === 0)"
    page.wait_for_function(f"({done})(Chart.getChart('chart-prefill').data.datasets)")
    again = chat(app, long, 2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 1024
    page.wait_for_function("Chart.getChart('chart-prefill').data.datasets[0].data.some((v) => v > 1024)")
    page.wait_for_function("+document.getElementById('k-cache').textContent >= 1")
    # Two requests that start together decode in one batch of two.
    results: list[dict[str, Any]] = []
    say = [{"role": "user", "content": "Count to five."}]
    threads = [threading.Thread(target=lambda: results.append(chat(app, say, 6))) for _ in range(2)]
    with engine_held(app.engine) as release:
        for t in threads:
            t.start()
        release(2)
    for t in threads:
        t.join(600)
    assert len(results) == 2
    page.wait_for_function("Chart.getChart('chart-batch').data.datasets[0].data.includes(2)")
    assert page.locator("#k-batch-max").inner_text() == "2"
    # Requests are named by arrival number and source ("#3 plain"), and none is left counted as running.
    assert page.evaluate("Chart.getChart('chart-time').data.labels.every((l) => /^#[0-9]+ [a-z]+$/.test(l))")
    page.wait_for_function("/^[0-9]+$/.test(document.getElementById('k-requests').textContent)")
    screenshot(page, "telemetry-live")


def chat(app: App, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens}
    r = httpx.post(app.base_url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def test_the_fit_table_of_a_fake_hub_repo(page: Any, app: App) -> None:
    page.goto("/ui/models")
    wait_ready(page)
    page.fill("#hub-query", "llama")
    page.click("#hub-search")
    page.locator("#hub-table button", has_text="Choose").first.click()
    page.wait_for_selector(".fit-row")
    rows = page.locator(".fit-row")
    expected = httpx.get(app.base_url + "/ui/api/models/fit", params={"repo": "fake-org/llama-8b-shaped"}).json()
    assert rows.count() == len(expected["rows"]) == 2
    for i, row in enumerate(expected["rows"]):
        assert rows.nth(i).get_attribute("data-verdict") == row["verdict"]
        assert rows.nth(i).locator("td").first.inner_text() == f"{row['context']:,}"
    assert "32 layers, 8 KV heads × 128" in page.locator("#fit-usable").inner_text()
    screenshot(page, "models-fit")


def test_a_download_shows_progress_to_done(page: Any, app: App) -> None:
    from tests.fakes.hub import FakeRepo, safetensors_bytes

    config = {"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 8}
    weights = safetensors_bytes({"w": ("F16", [1024, 1024])})
    files = {"config.json": json.dumps(config).encode(), "model.safetensors": weights}
    app.hub.add(FakeRepo(repo_id="fake-org/tiny-download", files=files))
    page.goto("/ui/models")
    wait_ready(page)
    page.fill("#fit-repo", "fake-org/tiny-download")
    page.click("#download-go")
    page.wait_for_selector(".download[data-status='done']")
    assert "2.0 MB / 2.0 MB" in page.locator(".download[data-status='done']").inner_text()
    page.wait_for_selector("#local-table td:text-is('fake-org/tiny-download')")
    screenshot(page, "models-download")


def test_the_roofline_measures_bandwidth_and_the_ceiling(page: Any, app: App) -> None:
    fill_and_go(page, "/ui/roofline", {"#roof-max": "8"}, "#roof-go")
    page.wait_for_function("document.body.dataset.roofline === '1'")
    assert page.locator("#r-bw").inner_text().endswith("GB/s")
    # Every drafter is ticked by default: plain decoding and the three sources.
    assert page.locator("#roof-table tbody tr").count() == 4
    screenshot(page, "roofline")


def test_a_reply_regenerates_and_a_question_comes_back_to_edit(page: Any, app: App) -> None:
    page.goto("/ui/chat")
    wait_ready(page)
    page.click("#new-session")  # a session of its own: earlier tests' sessions hold other turns
    page.wait_for_selector(".msgs .empty")
    page.fill("#max_tokens", "6")
    page.fill("#prompt", "Name a fruit.")
    page.click("#send")
    page.wait_for_selector(".msg.assistant .regen-msg")  # the saved turn, with its ids
    first = page.locator(".msg.assistant .body").last.inner_text()
    page.evaluate("document.querySelector('.msg.assistant').dataset.old = '1'")  # gone once the page re-renders
    page.locator(".msg.assistant .regen-msg").last.click()
    again = "!document.querySelector('[data-old]') && document.querySelectorAll('.msg').length === 2"
    page.wait_for_function(f"{again} && !!document.querySelector('.msg.assistant .regen-msg')")
    assert page.locator(".msg.assistant .body").last.inner_text() == first  # greedy: the same reply again
    page.locator(".msg.user .edit-msg").last.click()
    page.wait_for_function("document.getElementById('prompt').value === 'Name a fruit.'")
    assert page.locator(".msg").count() == 0  # the question left the history; it waits in the composer
    screenshot(page, "chat-edit")
