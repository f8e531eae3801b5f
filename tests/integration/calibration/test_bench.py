"""The bench use case on fakes: the --json schema, speedup against a baseline measured in the same run,
the lossless verdict (and its failure), the table, the clear message when matplotlib is missing, and a
reference decoder (`--against`) run beside ours with ratios and prefill tok/s computed from the clock."""

from __future__ import annotations

import importlib.util
import json
import statistics
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from mlx_dspark.application.auto_mode import AutoSelector, cap_policy_factory
from mlx_dspark.application.data import builtin_prompts, interleaved, load_prompts, per_class
from mlx_dspark.application.engine import decode
from mlx_dspark.application.generation import GenerationRequest, GenerationResult, GenerationService
from mlx_dspark.application.lab.bench import BENCH_SCHEMA, prefill_json, report_json, run_bench, run_prefill_bench
from mlx_dspark.application.ports import LoadedModel, ReferenceRun
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.events import TokensCommitted
from mlx_dspark.domain.ports import Clock
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from mlx_dspark.entrypoints.cli.bench_render import PlotUnavailable, plot_report, render_table
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.integration.calibration.timed_fakes import ManualClock, TimedSource, TimedTarget, flat, loaded


def prefill_s(tokens: int) -> float:
    """What the timed fake charges for one forward over `tokens` rows (`flat(0.05)`)."""
    return flat(0.05)(tokens, 0)


def generators() -> tuple[dict[str, GenerationService], LoadedModel]:
    clock = ManualClock(tick=1e-6)
    target = TimedTarget(clock, flat(0.05))
    model = loaded(target)
    sink = RecordingTelemetrySink()
    good = TimedSource(target, lambda cap: 0.001, right=lambda r, i: i < 3, block=5, name="dspark")
    gens = {
        "dspark": GenerationService(model, source=good, mode="dspark", clock=clock, telemetry=sink),
        "baseline": GenerationService(model, source=None, mode="baseline", clock=clock, telemetry=sink),
    }
    return gens, model


def test_prompt_set_is_versioned_and_large_enough() -> None:
    s = builtin_prompts()
    assert s.version and s.name == "mlx-dspark-bench"
    for cls in ("chat", "code", "math"):
        items = [p for p in s.prompts if p.cls == cls]
        assert len(items) >= 8
        assert max(len(p.prompt) for p in items) > 3 * min(len(p.prompt) for p in items)
    assert len({p.id for p in s.prompts}) == len(s.prompts)


def test_bench_json_schema() -> None:
    gens, _ = generators()
    prompts = load_prompts("chat,math")
    prompts = type(prompts)(
        name=prompts.name, version=prompts.version, prompts=prompts.prompts[:2] + prompts.prompts[-2:]
    )
    curves = {"dspark": CostCurves(verify_s={1: 0.05, 6: 0.06}, draft_s={1: 0.001, 5: 0.002})}
    report = run_bench(gens, prompts, trials=2, max_tokens=12, curves=curves, environment={"device": "fake"})
    doc = json.loads(json.dumps(report_json(report)))
    assert doc["schema"] == BENCH_SCHEMA
    assert doc["model"] == "fake" and doc["model_identity"] == "fake/target@rev1"
    assert doc["prompt_set"] == {
        "name": "mlx-dspark-bench",
        "version": prompts.version,
        "count": 4,
        "classes": ["chat", "math"],
    }
    assert doc["settings"] == {"trials": 2, "max_tokens": 12, "temperature": 0.0}
    assert doc["baseline"] == "baseline" and doc["reference"] is None
    assert [m["mode"] for m in doc["modes"]] == ["baseline", "dspark"]  # baseline measured first
    keys = {
        "mode", "runs", "decode_tok_s", "e2e_tok_s", "ttft_s", "mean_accepted", "speedup", "lossless",
        "mismatched_prompts", "per_class_decode_tok_s", "per_class_speedup", "sources", "prefill_tok_s",
        "decode_vs_reference", "prefill_vs_reference", "per_class_decode_vs_reference", "first_divergence",
        "vs_references",
    }  # fmt: skip
    for m in doc["modes"]:
        assert set(m) == keys
        assert m["runs"] == 8
        assert m["lossless"] is True and m["mismatched_prompts"] == []
        assert isinstance(m["decode_tok_s"], float) and m["decode_tok_s"] > 0
        assert set(m["per_class_decode_tok_s"]) == {"chat", "math"}
        assert m["decode_vs_reference"] is None and m["first_divergence"] == {}
        rates = [r["prefill_tok_s"] for r in doc["runs"] if r["mode"] == m["mode"]]
        assert m["prefill_tok_s"] == pytest.approx(statistics.median(rates))
    for r in doc["runs"]:  # the fake prefills n tokens in one forward of 0.05 + 0.0005 n seconds
        assert r["prefill_tok_s"] == pytest.approx(r["prompt_tokens"] / prefill_s(r["prompt_tokens"]), rel=1e-3)
    base, spec = doc["modes"]
    assert base["speedup"] == 1.0
    assert spec["speedup"] > 1.0  # a right drafter on a flat verify curve wins
    assert spec["mean_accepted"] > base["mean_accepted"] == 1.0
    assert set(doc["curves"]["dspark"]) == {"verify_s", "draft_s", "slope_s_per_token", "overhead_s"}
    assert doc["environment"] == {"device": "fake"}
    assert len(doc["runs"]) == 16 and {"mode", "prompt_id", "class", "trial"} <= set(doc["runs"][0])
    table = render_table(report)
    assert "speedup" in table and "dspark" in table and "yes" in table


class Garbler:
    """A runner that returns the baseline's output with one token changed (what a lossy mode would do)."""

    def __init__(self, inner: GenerationService) -> None:
        self._inner = inner

    @property
    def model(self) -> LoadedModel:
        return self._inner.model

    def generate(self, request: GenerationRequest) -> GenerationResult:
        r = self._inner.generate(request)
        ids = (*r.token_ids[:-1], (r.token_ids[-1] + 1) % 64)
        return attrs.evolve(r, token_ids=ids)

    def encode_prompt(self, request: GenerationRequest) -> list[int]:
        return self._inner.encode_prompt(request)


def test_lossless_check_catches_a_mismatch() -> None:
    gens, _ = generators()
    runners = {"baseline": gens["baseline"], "lossy": Garbler(gens["dspark"])}
    prompts = load_prompts("code")
    prompts = type(prompts)(name=prompts.name, version=prompts.version, prompts=prompts.prompts[:2])
    report = run_bench(runners, prompts, trials=1, max_tokens=6)
    lossy = next(m for m in report.modes if m.mode == "lossy")
    assert lossy.lossless is False and set(lossy.mismatched) == {"code-01", "code-02"}
    assert "NO" in render_table(report)


def test_sampled_runs_have_no_lossless_verdict() -> None:
    gens, _ = generators()
    prompts = load_prompts("math")
    prompts = type(prompts)(name=prompts.name, version=prompts.version, prompts=prompts.prompts[:1])
    report = run_bench(gens, prompts, trials=1, max_tokens=6, temperature=0.8)
    assert all(m.lossless is None for m in report.modes)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed")
def test_plot_without_matplotlib_says_how_to_get_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gens, _ = generators()
    prompts = load_prompts("chat")
    prompts = type(prompts)(name=prompts.name, version=prompts.version, prompts=prompts.prompts[:1])
    report = run_bench(gens, prompts, trials=1, max_tokens=4)
    with pytest.raises(PlotUnavailable, match=r"mlx-dspark\[plot\]"):
        plot_report(report, str(tmp_path / "x.png"))


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the optional plot extra is not installed")
def test_plot_writes_a_png(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gens, _ = generators()
    prompts = load_prompts("chat")
    prompts = type(prompts)(name=prompts.name, version=prompts.version, prompts=prompts.prompts[:1])
    curves = {"dspark": CostCurves(verify_s={1: 0.05, 6: 0.06}, draft_s={1: 0.001, 5: 0.002})}
    report = run_bench(gens, prompts, trials=1, max_tokens=4, curves=curves)
    out = tmp_path / "bench.png"
    plot_report(report, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_runs_auto_beside_fixed_modes_per_class() -> None:
    clock = ManualClock(tick=1e-6)
    target = TimedTarget(clock, flat(0.05))
    model = loaded(target)
    sink = RecordingTelemetrySink()
    good = TimedSource(target, lambda cap: 0.001, right=lambda r, i: i < 3, block=5, name="dspark")
    slow = TimedSource(target, lambda cap: 0.5, block=5, name="slow")  # the race liked it; it loses here
    policies = {n: cap_policy_factory(5, None, 5) for n in ("dspark", "slow")}
    auto = AutoSelector(
        {"dspark": good, "slow": slow, "baseline": None}, policies, {"slow": 100.0, "dspark": 50.0, "baseline": 15.0}
    )
    runners = {
        "baseline": GenerationService(model, clock=clock, telemetry=sink),
        "dspark": GenerationService(model, source=good, mode="dspark", clock=clock, telemetry=sink),
        "auto": GenerationService(model, selector=auto, clock=clock, telemetry=sink),
    }
    chat, code = (load_prompts(c) for c in ("chat", "code"))
    prompts = type(chat)(name=chat.name, version=chat.version, prompts=chat.prompts[:2] + code.prompts[:2])
    report = run_bench(runners, prompts, trials=1, max_tokens=48)
    by = {m.mode: m for m in report.modes}
    assert by["auto"].lossless and by["dspark"].lossless
    assert set(by["auto"].per_class_speedup) == {"chat", "code"}
    assert all(s is not None and s > 1 for s in by["auto"].per_class_speedup.values())
    assert by["dspark"].sources == {"dspark": 4} and by["auto"].sources == {"dspark": 4}
    doc = report_json(report)
    auto_doc = next(m for m in doc["modes"] if m["mode"] == "auto")
    assert set(auto_doc["per_class_speedup"]) == {"chat", "code"} and auto_doc["sources"] == {"dspark": 4}
    assert {r["source"] for r in doc["runs"] if r["mode"] == "auto"} == {"dspark"}
    table = render_table(report)
    assert "chat" in table.splitlines()[1] and "code" in table.splitlines()[1]
    # Issue 11's protocol: per class, auto's median against plain's and the best fixed mode's.
    verdicts = {v.cls: v for v in report.auto}
    assert set(verdicts) == {"chat", "code"}
    for cls, v in verdicts.items():
        assert v.best_mode == max(("baseline", "dspark"), key=lambda m: by[m].per_class[cls])
        assert v.vs_plain == pytest.approx(by["auto"].per_class[cls] / by["baseline"].per_class[cls])
        assert v.vs_best == pytest.approx(by["auto"].per_class[cls] / by[v.best_mode].per_class[cls])
        assert sum(v.rounds.values()) > 0
    rows = {r["class"]: r for r in doc["auto_per_class"]}
    assert rows["code"]["auto_vs_best_fixed"] == pytest.approx(verdicts["code"].vs_best)
    assert "auto per class" in table and "auto/best" in table


class ChargedReference:
    """A reference decoder with known costs: greedy decoding on its own copy of the oracle (so the same
    tokens as ours), charging the bench's clock `prefill_s` and then `step_s` per token after the first.
    `garble_at` changes that token (a reference that rounds differently)."""

    name = "ref"

    def __init__(self, *, prefill_s: float = 0.2, step_s: float = 0.02, garble_at: int | None = None) -> None:
        self.prefill_s, self.step_s, self.garble_at = prefill_s, step_s, garble_at
        self.prompts: list[list[int]] = []

    def generate(
        self, model: LoadedModel, prompt: Sequence[int], *, max_tokens: int, eos_ids: frozenset[int], clock: Clock
    ) -> ReferenceRun:
        own = TimedTarget(ManualClock(), flat(0.0), vocab=model.target.vocab_size)
        tokens: list[int] = []
        for ev in decode(own, list(prompt), SamplingParams(), StopRule(max_tokens=max_tokens, eos_ids=eos_ids),
                         FakeClock()):  # fmt: skip
            if isinstance(ev, TokensCommitted):
                tokens.extend(ev.tokens)
        if self.garble_at is not None and len(tokens) > self.garble_at:
            tokens[self.garble_at] = (tokens[self.garble_at] + 1) % model.target.vocab_size
        self.prompts.append(list(prompt))
        bench_clock = model.target.clock  # type: ignore[attr-defined]
        start = clock.now()
        bench_clock.advance(self.prefill_s)
        first = clock.now()
        bench_clock.advance(self.step_s * (len(tokens) - 1))
        return ReferenceRun(token_ids=tuple(tokens), prefill_s=first - start, decode_s=clock.now() - first)


def _prompts(cls: str, n: int):  # type: ignore[no-untyped-def]
    base = load_prompts(cls)
    return type(base)(name=base.name, version=base.version, prompts=base.prompts[:n])


def test_a_reference_runs_right_after_the_baseline_with_paired_ratios() -> None:
    gens, model = generators()
    ref = ChargedReference()
    prompts = _prompts("code", 2)
    report = run_bench(gens, prompts, trials=2, max_tokens=10, references=[ref], clock=model.target.clock)
    assert report.reference == "ref"
    assert [m.mode for m in report.modes] == ["baseline", "ref", "dspark"]
    # Per prompt and trial, back to back: ours, the reference, then the other modes.
    assert [r.mode for r in report.runs[:6]] == ["baseline", "ref", "dspark"] * 2
    # The reference decoded the very ids ours did (the warm-up, then one per prompt and trial).
    encoded = [gens["baseline"].encode_prompt(GenerationRequest(prompt=p.prompt)) for p in prompts.prompts]
    assert ref.prompts[1:] == encoded * 2
    by = {m.mode: m for m in report.modes}
    assert by["ref"].lossless is True and by["ref"].first_divergence == {}
    assert by["ref"].decode_tok_s == pytest.approx(1 / 0.02, rel=1e-3)
    runs = {(r.mode, r.prompt_id, r.trial): r for r in report.runs}
    for mode in ("baseline", "dspark"):
        mine = [r for r in report.runs if r.mode == mode]
        paired = [r.decode_tok_s / runs["ref", r.prompt_id, r.trial].decode_tok_s for r in mine]
        assert by[mode].decode_vs_reference == pytest.approx(statistics.median(paired))
        # The reference prefills in 0.2 s, ours in 0.05 + 0.0005 n.
        expected = statistics.median(0.2 / prefill_s(r.prompt_tokens) for r in mine)
        assert by[mode].prefill_vs_reference == pytest.approx(expected, rel=1e-3)
        assert set(by[mode].per_class_vs_reference) == {"code"}
    assert by["baseline"].decode_vs_reference == pytest.approx((1 / prefill_s(1)) / (1 / 0.02), rel=1e-3)  # one step
    assert by["dspark"].decode_vs_reference > by["baseline"].decode_vs_reference  # the drafter wins here
    doc = json.loads(json.dumps(report_json(report)))
    assert doc["reference"] == "ref"
    ref_doc = next(m for m in doc["modes"] if m["mode"] == "ref")
    assert ref_doc["decode_vs_reference"] == pytest.approx(1.0) and ref_doc["lossless"] is True
    assert all(r["prefill_tok_s"] > 0 for r in doc["runs"])
    table = render_table(report)
    assert "decode/ref" in table and "prefill/ref" in table and "prefill tok/s" in table


class NamedReference(ChargedReference):
    def __init__(self, name: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.name = name


def test_several_references_pair_each_and_headline_the_fastest() -> None:
    gens, model = generators()
    slow, fast = NamedReference("slow", step_s=0.04), NamedReference("fast", step_s=0.01)
    report = run_bench(gens, _prompts("code", 2), trials=1, max_tokens=10, references=[slow, fast],
                       clock=model.target.clock)  # fmt: skip
    assert report.references == ("slow", "fast") and report.reference == "fast"
    assert [m.mode for m in report.modes] == ["baseline", "slow", "fast", "dspark"]
    assert [r.mode for r in report.runs[:4]] == ["baseline", "slow", "fast", "dspark"]
    by = {m.mode: m for m in report.modes}
    for m in report.modes:
        assert set(m.vs_references) == {"slow", "fast"}
        # The same runs against a reference 4x slower: every paired ratio 4x higher.
        assert m.vs_references["slow"].decode == pytest.approx(4 * m.vs_references["fast"].decode, rel=1e-3)
        assert m.decode_vs_reference == m.vs_references["fast"].decode
        assert m.per_class_vs_reference == m.vs_references["fast"].per_class
    assert by["fast"].decode_vs_reference == pytest.approx(1.0)
    doc = json.loads(json.dumps(report_json(report)))
    assert doc["reference"] == "fast" and doc["references"] == ["slow", "fast"]
    slow_base = by["baseline"].vs_references["slow"].decode
    assert doc["modes"][0]["vs_references"]["slow"]["decode"] == pytest.approx(slow_base)
    table = render_table(report)
    assert "decode/slow" in table and "decode/fast" in table and "prefill/fast" in table
    assert "the fastest reference is fast" in table
    with pytest.raises(ValueError, match="distinct"):
        run_bench(gens, _prompts("code", 1), trials=1, max_tokens=4, references=[slow, NamedReference("slow")])


def test_a_reference_that_diverges_reports_where() -> None:
    gens, model = generators()
    report = run_bench(
        gens, _prompts("math", 2), trials=1, max_tokens=8, references=[ChargedReference(garble_at=3)],
        clock=model.target.clock,
    )  # fmt: skip
    by = {m.mode: m for m in report.modes}
    assert by["ref"].lossless is False
    assert by["ref"].first_divergence == {"math-01": 3, "math-02": 3}
    assert by["baseline"].lossless and by["dspark"].lossless
    assert "differs: math-01@3, math-02@3" in render_table(report)


def test_a_reference_needs_greedy() -> None:
    gens, _ = generators()
    with pytest.raises(Exception, match="greedy"):
        run_bench(gens, _prompts("chat", 1), trials=1, max_tokens=4, temperature=0.7, references=[ChargedReference()])


def test_prefill_alone_at_each_length_against_the_reference() -> None:
    gens, model = generators()
    ref = ChargedReference(prefill_s=0.2)
    points = run_prefill_bench(gens["baseline"], [8, 40, 10_000], reference=ref, trials=2, clock=model.target.clock)
    assert [p.tokens for p in points] == [8, 40, model.context_window - 1]  # cut to fit the window
    for p in points:
        assert len(p.ours_s) == len(p.reference_s) == 2 and p.same_first_token is True
    for p in points[:2]:  # one forward each (longer prompts go in pieces, whose extends the fake does not charge)
        assert p.ours_tok_s == pytest.approx(p.tokens / prefill_s(p.tokens), rel=1e-3)
        assert p.reference_tok_s == pytest.approx(p.tokens / 0.2, rel=1e-3)
        assert p.ratio == pytest.approx(0.2 / prefill_s(p.tokens), rel=1e-3)
    assert [len(ids) for ids in ref.prompts[1:]] == [8, 8, 40, 40, 4095, 4095]  # after one warm-up
    doc = json.loads(json.dumps(prefill_json(points, "ref")))
    assert doc["reference"] == "ref" and [q["tokens"] for q in doc["points"]] == [8, 40, 4095]
    alone = run_prefill_bench(gens["baseline"], [16], trials=1)
    assert alone[0].reference_tok_s is None and alone[0].ratio is None and alone[0].ours_tok_s > 0


def test_heldout_prompts_and_per_class_selection() -> None:
    held = load_prompts("heldout")
    assert [sum(p.cls == c for p in held.prompts) for c in ("chat", "code", "math")] == [10, 10, 10]
    assert not {p.prompt for p in held.prompts} & {p.prompt for p in builtin_prompts().prompts}
    few = per_class(load_prompts("heldout:code,math"), 3)
    assert [p.id for p in few.prompts] == ["code-01", "code-02", "code-03", "math-01", "math-02", "math-03"]
    with pytest.raises(InvalidRequest):
        load_prompts("heldout:poetry")
    with pytest.raises(InvalidRequest):
        per_class(held, 0)


def test_interleaved_prompts_mix_the_classes_and_keep_every_prompt() -> None:
    held = per_class(load_prompts("heldout"), 2)
    mixed = interleaved(held)
    assert [p.id for p in mixed.prompts] == ["chat-01", "code-01", "math-01", "chat-02", "code-02", "math-02"]
    uneven = attrs.evolve(held, prompts=held.prompts[:3])  # chat-01, chat-02, code-01
    assert [p.id for p in interleaved(uneven).prompts] == ["chat-01", "code-01", "chat-02"]
