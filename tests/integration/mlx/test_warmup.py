"""The warm-up before the first request: it runs every cap's rounds of the served mode once (greedy and seeded),
changes nothing a later request sees, runs where the device compiles kernels (or when asked), and never stops a
model from being served."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.generation import GenerationRequest, GenerationService
from mlx_dspark.application.prefix_cache import PrefixCache
from mlx_dspark.application.settings import load_settings
from mlx_dspark.application.warmup import WarmingServe, sources_of, wanted, warm_up
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.tokens import SamplingParams
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.integration.mlx import test_batching_speculative as rig

BLOCK = rig.BLOCK


def _spy_widths(service: GenerationService) -> list[int]:
    """Every verify's width (anchor + drafts) the service's target runs from now on."""
    target = service.model.target
    widths: list[int] = []
    verify = target.verify

    def spy(anchor: int, block: Any, *args: Any, **kwargs: Any) -> Any:
        widths.append(1 + len(block))
        return verify(anchor, block, *args, **kwargs)

    target.verify = spy  # type: ignore[method-assign]
    return widths


@pytest.mark.parametrize("kind", ["dspark", "lookup"])
def test_the_warm_up_verifies_at_every_width_of_the_mode(kind: str) -> None:
    served = rig.service(kind)
    block = served.selector.source.max_block  # type: ignore[attr-defined]
    widths = _spy_widths(served)
    done = warm_up(served)
    assert done.covered == tuple((kind, cap) for cap in range(1, block + 1))
    assert done.requests == block + 1  # every cap greedy, and the largest seeded
    # A drafter always fills its cap, so every width ran; lookup drafts only what its index matches in the
    # model's output (here none), and every round still verified.
    assert set(range(2, block + 2)) <= set(widths) if kind == "dspark" else widths


def test_plain_decoding_warms_one_greedy_and_one_seeded_request() -> None:
    base = rig.service("dspark")
    plain = GenerationService(base.model, clock=FakeClock(), telemetry=RecordingTelemetrySink())
    assert sources_of(plain) == {"baseline": None}
    assert warm_up(plain).requests == 2


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_after_the_warm_up_a_request_runs_as_on_a_fresh_service_and_nothing_was_cached(sampled: bool) -> None:
    base = rig.service("dspark")
    cache = PrefixCache(1 << 26)
    telemetry = RecordingTelemetrySink()
    served = GenerationService(
        base.model,
        source=base.selector.source,  # type: ignore[attr-defined]
        mode="dspark",
        clock=FakeClock(),
        telemetry=telemetry,
        cap_policy_factory=lambda: FixedCap(BLOCK),
        prefix_cache=cache,
    )
    warm_up(served)
    assert cache.entries(served.model.target.state_tag) == []  # the warm-up saved no prefix
    assert telemetry.events == []  # and reported nothing
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=5) if sampled else SamplingParams()
    request = GenerationRequest(prompt=(7, 8, 9, 7, 8, 9, 7, 8), max_tokens=20, sampling=sampling)
    got = served.generate(request)
    want = rig.solo("dspark", request)
    assert got.token_ids == want.token_ids
    assert (got.rounds, got.drafted, got.accepted) == (want.rounds, want.drafted, want.accepted)


def test_auto_warms_where_the_device_compiles_kernels_and_the_setting_decides_otherwise() -> None:
    assert wanted("auto", True) and not wanted("auto", False)
    assert wanted("on", False) and not wanted("off", True)
    with pytest.raises(ValueError, match="warmup must be one of"):
        wanted("sometimes", True)
    assert load_settings({"warmup": "on"}).server.warmup == "on"
    assert load_settings({}, environ={"MLX_DSPARK_WARMUP": "off"}).server.warmup == "off"
    with pytest.raises(InvalidRequest, match="warmup must be one of auto, on, off"):
        load_settings({"warmup": "always"})


def test_the_serve_hook_warms_then_hands_on_and_a_failed_warm_up_still_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    served = rig.service("lookup")
    handed: list[GenerationService] = []
    hook = WarmingServe(True, handed.append)
    hook(served)
    assert hook.last is not None and hook.last.requests == BLOCK + 1 and handed == [served]
    off = WarmingServe(False, handed.append)
    off(served)
    assert off.last is None and handed == [served, served]

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("kernel compile failed")

    monkeypatch.setattr("mlx_dspark.application.warmup.warm_up", broken)
    failing = WarmingServe(True, handed.append)
    failing(served)
    assert failing.last is None and len(handed) == 3


def test_the_server_face_warms_on_the_runtime_s_word_unless_told() -> None:
    on_cpu = bootstrap.runtime().compiles_kernels()
    for setting, expected in (("auto", on_cpu), ("on", True), ("off", False)):
        settings = load_settings({"warmup": setting})
        server = bootstrap.build_server(bootstrap.build(settings), settings)
        hook = server.engine._on_serve
        assert isinstance(hook, WarmingServe) and hook.enabled is expected


def test_auto_also_warms_a_drafter_catching_up_on_many_rows_at_once() -> None:
    from mlx_dspark.application.auto_mode import AutoSelector
    from mlx_dspark.application.warmup import CATCH_UP, CATCH_UP_ROUNDS
    from mlx_dspark.domain.drafting.selection import PLAIN

    fixed = rig.service("dspark")
    source: Any = fixed.selector.source  # type: ignore[attr-defined]
    selector = AutoSelector(
        {"dspark": source, PLAIN: None}, {"dspark": lambda: FixedCap(BLOCK)}, {"dspark": 10.0, PLAIN: 5.0}
    )
    auto = GenerationService(fixed.model, selector=selector, clock=FakeClock(), telemetry=RecordingTelemetrySink())
    caught: list[int] = []
    ingest = source.ingest

    def spy(ctx: Any) -> None:
        caught.append(0 if ctx.features is None else int(ctx.features.shape[-2]))
        ingest(ctx)

    source.ingest = spy
    try:
        done = warm_up(auto)
    finally:
        del source.ingest
    assert ("dspark", CATCH_UP) in done.covered and (PLAIN, 0) in done.covered
    assert done.requests == (source.max_block + 1) + 2 + 1  # dspark's caps and seeded, plain's two, one catch-up
    # The catch-up request's first drafter round took every row decoded plainly before it, at once.
    assert max(caught) >= CATCH_UP_ROUNDS
    # A fixed mode has no drafter to come back to: no catch-up request.
    assert all(cap != CATCH_UP for _, cap in warm_up(fixed).covered)
