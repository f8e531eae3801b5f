"""The bench use case on fakes: the --json schema, speedup against a baseline measured in the same run,
the lossless verdict (and its failure), the table, and the clear message when matplotlib is missing."""

from __future__ import annotations

import importlib.util
import json

import attrs
import pytest

from mlx_dspark.application.auto_mode import AutoSelector, cap_policy_factory
from mlx_dspark.application.bench import BENCH_SCHEMA, report_json, run_bench
from mlx_dspark.application.data import builtin_prompts, load_prompts
from mlx_dspark.application.generation import GenerationRequest, GenerationResult, GenerationService
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.entrypoints.cli.bench_render import PlotUnavailable, plot_report, render_table
from tests.fakes.clock import RecordingTelemetrySink
from tests.integration.calibration.timed_fakes import ManualClock, TimedSource, TimedTarget, flat, loaded


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
    assert doc["baseline"] == "baseline"
    assert [m["mode"] for m in doc["modes"]] == ["baseline", "dspark"]  # baseline measured first
    keys = {
        "mode", "runs", "decode_tok_s", "e2e_tok_s", "ttft_s", "mean_accepted", "speedup", "lossless",
        "mismatched_prompts", "per_class_decode_tok_s", "per_class_speedup", "sources",
    }  # fmt: skip
    for m in doc["modes"]:
        assert set(m) == keys
        assert m["runs"] == 8
        assert m["lossless"] is True and m["mismatched_prompts"] == []
        assert isinstance(m["decode_tok_s"], float) and m["decode_tok_s"] > 0
        assert set(m["per_class_decode_tok_s"]) == {"chat", "math"}
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
