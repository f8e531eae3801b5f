"""scripts/device_bench.py on the CPU (MLX runs the same graphs there as on the GPU): the oracle forces exactly
the acceptance it is asked for on random-weight targets in fp32 and bf16 without disturbing the target's cache,
the synthetic and real benches write their documents (the real one in the `bench --json` schema), a budget
stops them between runs with what was measured, and the per-round accounting adds up."""

from __future__ import annotations

import importlib.util
import json
import os
import time
import types
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import pytest

from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.generation import MonotonicClock
from mlx_dspark.application.lab.bench import BENCH_SCHEMA, synthetic_prompt
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.events import RoundFinished
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from mlx_dspark.domain.verification.distribution import argmax
from mlx_dspark.domain.verification.greedy import longest_accepted_prefix
from mlx_dspark.domain.verification.outcome import Acceptance
from tests.fakes.oracle import OracleTarget, oracle_logits
from tests.fakes.tiny_models import tiny_model

try:  # the decode loop moves into application.engine (issue 26's rewrite)
    from mlx_dspark.application.engine import decode
except ImportError:
    from mlx_dspark.application.decode_loop import decode

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "device_bench.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _random_target(bench: ModuleType, shape: str, dtype: Any) -> MlxTargetModel:
    family, cfg = bench.shape_config(shape, tiny=True)
    return MlxTargetModel(bench.random_model(family, cfg, dtype, seed=3))


# The shapes' own init (N(0, 1/fan_in)) leaves near-flat logits: near-ties everywhere, where a plain-decoding
# reference would not force anything. "32b" is qwen2 (biases), "hybrid" qwen3_5 (snapshot rollback).
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", ["4b", "32b", "hybrid"])
def test_every_round_accepts_exactly_the_forced_tau(bench: ModuleType, shape: str, dtype: Any) -> None:
    target = _random_target(bench, shape, dtype)
    prompt = synthetic_prompt(24, target.vocab_size, seed=5)
    for tau in (0, 2, 5, 7):
        for cap in dict.fromkeys((7, tau + 1)):
            run = bench.forced_run(target, prompt, tau, cap, 30)
            rounds = run["per_round"]
            assert run["generated"] == 30
            assert [r["accepted"] for r in rounds] == [min(tau, r["cap"]) for r in rounds], (tau, cap)
            assert all(r["committed"] == r["accepted"] + 1 for r in rounds)  # bonus included
            assert run["full_rounds"] >= 2
            assert run["tokens_per_round"] == min(tau, cap) + 1 == run["ideal_tokens_per_round"]
            assert run["forced"] and run["oracle_unstable_passes"] == 0


class WidthRounding(OracleTarget):
    """A target whose verify rounds differently at every width, as reduced-precision kernels do: each row's
    logits get a small offset that depends on how many rows the forward has, so a plain step (one row) and a
    wide verify disagree wherever the top two are close."""

    def choice(self, prefix: Sequence[int], width: int) -> int:
        noise = oracle_logits([*prefix, -width], self.vocab_size, 3, sharpness=0.8)
        return argmax([a + b for a, b in zip(self.logits(prefix), noise)])

    def verify(self, anchor: int, block: DraftBlock, sampling: SamplingParams, uniforms: Any, **_: Any) -> Acceptance:
        rows = [anchor, *block.tokens]
        self._pending = rows
        choices = [self.choice([*self.rows, *rows[: i + 1]], len(rows)) for i in range(len(rows))]
        return longest_accepted_prefix(block.tokens, choices)


class PlainReferenceDrafts:
    """The naive oracle: plain decoding's own continuation for τ slots, then a token plain decoding rejects."""

    name, max_block, uses_features = "naive", 16, False

    def __init__(self, target: WidthRounding, tau: int) -> None:
        self._target, self._tau = target, tau

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Any) -> DraftBlock:
        seq = list(ctx.history)
        for _ in range(min(self._tau, cap) + 1):
            seq.append(self._target.choice(seq, 1))
        drafts = seq[len(ctx.history) :]
        drafts[-1] = (drafts[-1] + 1) % self._target.vocab_size
        return DraftBlock(tokens=tuple(drafts[:cap]))


def _accepted(target: Any, source: Any, cap: int, tokens: int = 60) -> list[int]:
    stop = StopRule(max_tokens=tokens, eos_ids=frozenset())
    events = decode(
        target, [3, 1, 4], SamplingParams(), stop, MonotonicClock(), source=source, cap_policy=FixedCap(cap)
    )
    return [e.accepted for e in events if isinstance(e, RoundFinished) and e.cap == cap]


def test_the_oracle_forces_tau_where_a_plain_reference_does_not(bench: ModuleType) -> None:
    """The failure the oracle exists for, on a target whose rounding depends on the verify's width."""
    for tau, cap in ((4, 7), (4, 5), (7, 7)):
        naive = _accepted(
            WidthRounding(vocab=32, context=3), PlainReferenceDrafts(WidthRounding(vocab=32, context=3), tau), cap
        )
        target = WidthRounding(vocab=32, context=3)
        forced = _accepted(target, bench.ForcedAcceptanceOracle(target, tau), cap)
        assert min(naive) < tau and sum(naive) / len(naive) < tau - 1  # rejected early, round after round
        assert forced == [tau] * len(forced) and len(forced) >= 5


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_oracle_passes_leave_the_cache_exact(bench: ModuleType, family: str) -> None:
    """fp32 with clear margins: the oracle's verify-and-rollback passes change nothing, so its output is
    plain decoding's token for token (a corrupted cache would diverge)."""
    target = MlxTargetModel(tiny_model(family, seed=4))
    prompt = synthetic_prompt(20, target.vocab_size, seed=2)
    plain = bench.plain_run(target, prompt, 40)["token_ids"]
    for tau, cap in ((0, 1), (3, 7), (7, 7)):
        assert bench.forced_run(target, prompt, tau, cap, 40)["token_ids"] == plain


def test_synthetic_smoke_writes_its_document_and_table(bench: ModuleType, tmp_path: Path) -> None:
    out, table = tmp_path / "syn.json", tmp_path / "syn.md"
    assert bench.main(["synthetic", "--smoke", "--shapes", "4b,hybrid", "--json", str(out), "--table", str(table)]) == 0
    doc = json.loads(out.read_text())
    section = doc["synthetic"]
    assert not section["stopped_by_budget"]
    assert [(s["shape"], s["dtype"]) for s in section["shapes"]] == [
        ("4b", "fp32"),
        ("4b", "bf16"),
        ("hybrid", "fp32"),
        ("hybrid", "bf16"),
    ]
    for s in section["shapes"]:
        assert s["logits_finite"] and s["plain_step_s"] > 0
        assert [(r["tau"], r["cap"]) for r in s["forced"]] == [(1, 2), (1, 7), (2, 3), (2, 7)]
        for r in s["forced"]:
            assert r["forced"] and r["tokens_per_round"] == r["ideal_tokens_per_round"] == r["tau"] + 1
            assert r["efficiency"] == pytest.approx(s["plain_step_s"] / r["round_s"])
            assert r["speedup"] == pytest.approx(r["efficiency"] * r["ideal_tokens_per_round"])
    text = table.read_text()
    assert "| hybrid | bf16 |" in text and "tau = 4 speedup" in text


def test_budget_stops_between_runs_and_keeps_what_was_measured(bench: ModuleType, tmp_path: Path) -> None:
    ticks = iter(range(10_000))
    out = tmp_path / "syn.json"
    args = ["synthetic", "--smoke", "--shapes", "4b", "--budget-seconds", "3", "--json", str(out)]
    assert bench.main(args, clock=lambda: float(next(ticks))) == 0  # one tick per budget check
    section = json.loads(out.read_text())["synthetic"]
    assert section["stopped_by_budget"]
    measured = [r for s in section["shapes"] for r in s.get("forced", [])]
    assert 0 < len(measured) < 8  # smoke: 2 dtypes x 4 (tau, cap) runs
    assert all(r["forced"] for r in measured)


def test_first_prompt_has_a_length_no_request_had(bench: ModuleType) -> None:
    pool = [{"id": "a", "class": "chat", "ids": [1, 2, 3, 9]}, {"id": "b", "class": "code", "ids": [4, 5, 9]}]
    assert bench.first_prompt(pool, {4})["id"] == "b"
    p = bench.first_prompt(pool, {3, 4, 5, 6})
    assert len(p["ids"]) == 7 and p["ids"][0] == 1 and p["ids"][-3:] == [2, 3, 9]  # same start and end


def test_round_accounting_adds_up(bench: ModuleType) -> None:
    """Calls timed by hand: a drafted round, a plain one; every share is where the timestamps put it."""
    calls = bench.RoundCalls()

    def call(kind: str, start: float, end: float, dispatches: tuple[tuple[float, float], ...] = (), barrier=0.0):
        c = bench._Call(kind)
        c.start, c.end, c.dispatches, c.barrier_s = start, end, list(dispatches), barrier
        calls.calls.append(c)

    call("propose", 0.0, 3.0, ((1.0, 1.5),), barrier=1.0)
    call("verify", 3.0, 8.0, ((4.0, 5.0),))
    call("commit", 8.0, 8.5)
    call("verify", 9.0, 12.0, ((9.5, 10.0), (10.5, 11.0)))
    call("commit", 12.0, 12.25)
    first, second = calls.rounds()
    assert first == {
        "round_s": 9.0,
        "draft_s": 2.0,
        "draft_build_s": 1.0,
        "drafter_device_s": 1.0,
        "verify_build_s": 1.0,
        "dispatch_s": 1.5,
        "readback_s": 3.0,
        "commit_s": 0.5,
        "loop_other_s": 0.5,
        "host_s": 5.0,
    }
    assert second["round_s"] == 3.25 and second["readback_s"] == 1.0 and second["draft_s"] == 0.0
    assert second["verify_build_s"] == 0.5 and second["dispatch_s"] == 1.0


@pytest.fixture(scope="module")
def tiny_export(bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny llama GGUF (quantized blocks, BPE tokenizer, chat template) exported as for the device, and
    DSpark / DFlash checkpoints fitted to it in the published formats."""
    from tests.integration.drafters import helpers
    from tests.integration.hf import tiny_models as tm

    root = tmp_path_factory.mktemp("export")
    _, weights = tm.build_reference("llama", seed=1)
    tm.write_gguf("llama", weights, root / "tiny.gguf", quantize=True)
    info = bench.export(root / "tiny.gguf", root / "export")
    assert bench.PROMPTS_FILE in info["files"]
    target = bench.load_module(root / "export", "float32")
    layers = dict(layer_ids=(0, 1), num_target_layers=2)
    dspark = helpers.write_dspark(root / "dspark", target, **layers)  # type: ignore[arg-type]
    dflash = helpers.write_dflash(root / "dflash", vocab=len(tm.vocabulary()), **layers)  # type: ignore[arg-type]
    return {"model": root / "export", "dspark": dspark, "dflash": dflash}


def test_real_bench_runs_every_mode_through_the_generation_service(
    bench: ModuleType, tiny_export: dict[str, Path], tmp_path: Path
) -> None:
    out, table = tmp_path / "real.json", tmp_path / "real.md"
    args = ["real", "--model", str(tiny_export["model"]), "--model-dtype", "float32", "--max-tokens", "10"]
    args += ["--prompts", "2", "--dspark", str(tiny_export["dspark"]), "--dflash", str(tiny_export["dflash"])]
    assert bench.main([*args, "--json", str(out), "--table", str(table)]) == 0
    doc = json.loads(out.read_text())

    assert doc["schema"] == BENCH_SCHEMA  # the `mlx-dspark bench --json` document
    modes = ["baseline", "lookup", "dspark", "dflash", "auto"]
    assert [m["mode"] for m in doc["modes"]] == modes
    assert all(m["lossless"] for m in doc["modes"])  # fp32 on the CPU: greedy equals plain decoding
    assert {r["mode"] for r in doc["runs"]} == set(modes) and len(doc["runs"]) == 2 * len(modes)
    # The seen-once pass runs prompt by prompt, every mode back to back (host drift moves all modes alike).
    assert [r["mode"] for r in doc["runs"]] == modes * 2
    assert len({r["prompt_id"] for r in doc["runs"][: len(modes)]}) == 1
    extra = doc["device_bench"]
    assert not extra["stopped_by_budget"] and not extra["drafter_errors"]
    seen = {r["prompt_tokens"] for r in doc["runs"]}
    firsts = [extra["modes"][m]["first_request"]["prompt_tokens"] for m in modes]
    assert len(set(firsts)) == len(modes) and not seen & set(firsts)  # each a length never run before
    for mode in modes:
        m = extra["modes"][mode]
        assert "error" not in m, m.get("traceback")
        assert len(m["new_to_mode"]) == len(m["seen_once"]) == 2
        assert all(m["identical_to_plain"].values())
        for run in m["seen_once"]:  # one trace row per round: its source, and its commits add up
            trace = run["trace"]
            assert sum(t[2] for t in trace) == run["generated_tokens"] - 1
            assert all(t[3] > 0 for t in trace) and sum(run["source_rounds"].values()) == len(trace)
            assert {t[0] for t in trace} - {"none"} <= set(run["source_rounds"])  # none: nothing drafted
        for name in ("marked", "profiled"):
            b = m[name]["breakdown"]
            assert b["rounds"] >= 1 and b["readback_s"] >= 0
            assert b["round_s"] >= b["host_s"] >= b["verify_build_s"]
        if mode in ("dspark", "dflash"):
            assert m["marked"]["breakdown"]["drafter_device_s"] == 0.0  # only the profiled pass waits
            assert m["profiled"]["breakdown"]["drafter_device_s"] > 0
    assert "race_winner" in extra["modes"]["auto"]
    # auto's records carry what the next request expects of each candidate
    assert set(extra["modes"]["auto"]["seen_once"][-1]["priors_after"]) == {"baseline", "lookup", "dspark", "dflash"}
    assert "priors_after" not in extra["modes"]["dspark"]["seen_once"][-1]
    assert all(f"| {mode} |" in table.read_text() for mode in modes)


def test_with_warmup_each_mode_runs_the_servers_warm_up_before_its_first_request(
    bench: ModuleType, tiny_export: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "real.json"
    args = ["real", "--model", str(tiny_export["model"]), "--model-dtype", "float32", "--max-tokens", "6"]
    args += ["--prompts", "1", "--modes", "baseline,dspark", "--dspark", str(tiny_export["dspark"]), "--warmup"]
    assert bench.main([*args, "--json", str(out)]) == 0
    modes = json.loads(out.read_text())["device_bench"]["modes"]
    assert modes["baseline"]["warmup"]["requests"] == 2  # greedy and seeded
    assert modes["dspark"]["warmup"]["requests"] >= 2 and modes["dspark"]["warmup"]["seconds"] > 0
    assert all("error" not in m and m["first_request"]["generated_tokens"] > 0 for m in modes.values())


def test_sources_under_a_switcher_that_never_moves_decode_as_their_fixed_modes(
    bench: ModuleType, tiny_export: dict[str, Path], tmp_path: Path
) -> None:
    # The A/Bs for auto's rounds: the same plain steps (baseline-capture) or the same source, cap and rounds
    # (dspark-stay), with features recorded and kept every round and a switcher asked after each, as in auto.
    out = tmp_path / "real.json"
    args = ["real", "--model", str(tiny_export["model"]), "--model-dtype", "float32", "--max-tokens", "8"]
    args += ["--prompts", "2", "--modes", "baseline,baseline-capture,dspark,dspark-stay,dspark-late3"]
    assert bench.main([*args, "--dspark", str(tiny_export["dspark"]), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    modes = doc["device_bench"]["modes"]
    assert list(modes) == ["baseline", "baseline-capture", "dspark", "dspark-stay", "dspark-late3"]
    assert all("error" not in m for m in modes.values())
    capture = modes["baseline-capture"]
    assert all(capture["identical_to_plain"].values()) and all(v is None for v in capture["divergences"].values())
    rounds = capture["marked"]["breakdown"]["rounds"]
    assert rounds == capture["marked"]["generated_tokens"] - 1  # one plain step a round, no draft
    assert set(modes["dspark"]["divergences"]) == set(modes["dspark"]["identical_to_plain"])
    assert all(modes["dspark-stay"]["identical_to_plain"].values())
    stay = {r["prompt_id"]: r["source_rounds"] for r in doc["runs"] if r["mode"] == "dspark-stay"}
    assert stay == {r["prompt_id"]: r["source_rounds"] for r in doc["runs"] if r["mode"] == "dspark"}
    # dspark-late3: three plain rounds, then DSpark catches up on every row since (auto's move to an idle drafter).
    late = modes["dspark-late3"]
    assert all(late["identical_to_plain"].values())
    for run in late["seen_once"]:
        assert run["switches"] == ["3: baseline->dspark: after 3 plain rounds"], run["switches"]
        assert [row[0] for row in run["trace"][:4]] == ["none", "none", "none", "dspark"], run["trace"]


def test_a_divergence_is_located_and_read_as_a_near_tie_or_not(bench: ModuleType, tiny_export: dict[str, Path]) -> None:
    module = bench.load_module(tiny_export["model"], "float32")
    target = bench.MlxTargetModel(module)
    prompt = [5, 9, 13, 17, 21]
    plain = [target.prefill(prompt, bench.SamplingParams(), 0.5)]
    for _ in range(7):
        plain.append(target.verify(plain[-1], bench.EMPTY_BLOCK, bench.SamplingParams(), (0.5,)).next_token)
        target.commit(1)
    assert bench.divergence_report(module, prompt, plain, list(plain), []) is None
    # A token plain decoding did not choose, at index 4 of rounds of one step each: no near-tie, not reproduced.
    spec = [*plain[:4], (plain[4] + 1) % 64, *plain[5:]]
    rounds = [
        bench.RoundFinished(
            index=i, source="none", cap=0, drafted=0, accepted=0, committed=1, draft_s=0.0, verify_s=0.0, depth=0
        )
        for i in range(7)
    ]
    report = bench.divergence_report(module, prompt, plain, spec, rounds)
    assert report is not None and report["index"] == 4 and report["tokens"] == [plain[4], spec[4]]
    assert report["width"] == 1 and report["row"] == 0
    assert report["reproduced"] is False and report["near_tie"] is False
    assert bench.divergence_report(module, prompt, plain, plain[:3], rounds)["why"] == "one output stopped early"


# The GPU host has MLX, mlx-lm and their own dependencies, attrs and numpy; not these, nor an installed mlx_dspark.
BARE_HOST = """
import runpy, sys
MISSING = {"transformers", "tokenizers", "jinja2", "cattrs", "numba", "gguf", "structlog", "litestar", "mlx_dspark"}
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in MISSING and name not in sys.modules:
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Missing())
script, *sys.argv[1:] = sys.argv[1:]
sys.argv[0] = script
MISSING.discard("mlx_dspark")  # the script maps it onto the checkout's folders itself
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exit:
    names = ("transformers", "cattrs", "mlx_dspark")
    stand_ins = [n for n in names if getattr(sys.modules[n], "__file__", None) is None]
    print("stand-ins:", ",".join(stand_ins), "tokenizers" in sys.modules)
    sys.exit(exit.code)
"""


def test_runs_on_a_bare_host_without_tokenizer_libraries_or_an_install(
    bench: ModuleType, tiny_export: dict[str, Path], tmp_path: Path
) -> None:
    import subprocess
    import sys
    import sysconfig

    out = tmp_path / "smoke.json"
    args = ["all", "--smoke", "--model", str(tiny_export["model"]), "--modes", "baseline,lookup,dspark"]
    args += ["--dspark", str(tiny_export["dspark"]), "--shapes", "4b", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    # -S: no site processing, so the editable install's finder is not on the path either.
    command = [sys.executable, "-S", "-c", BARE_HOST, str(SCRIPT), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stand-ins: transformers,cattrs,mlx_dspark False" in done.stdout
    doc = json.loads(out.read_text())
    assert [m["mode"] for m in doc["modes"]] == ["baseline", "lookup", "dspark"]
    assert all("error" not in m for m in doc["device_bench"]["modes"].values())
    assert all(r["forced"] for s in doc["synthetic"]["shapes"] for r in s["forced"])


@pytest.mark.parametrize(
    ("info", "expected"),
    [({"memory_size": 96 << 30}, 96 << 30), ({"total_memory": "150754820096"}, 150754820096)],
    ids=["metal", "cuda"],
)
def test_the_gpu_memory_is_read_from_either_backends_device_info(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, info: dict[str, Any], expected: int
) -> None:
    # The CUDA build names it total_memory, as a string: read as 0 there, every synthetic shape "did not fit".
    monkeypatch.setattr(bench.mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(bench.mx, "device_info", lambda: info)
    assert bench.device_memory_bytes() == expected


def test_a_stalled_round_is_sampled_where_the_host_is(bench: ModuleType) -> None:
    telemetry = bench._NullTelemetry()
    watch = bench._StallWatch(telemetry, after_s=0.1, every_s=0.02)

    def a_slow_place() -> None:
        time.sleep(0.4)

    watch.arm()
    a_slow_place()
    watch.disarm()
    assert watch.samples, "a 0.4 s round past a 0.1 s threshold was never sampled"
    assert all(s["round"] == 0 and s["waited_ms"] >= 100 for s in watch.samples)
    assert any("a_slow_place" in frame for frame in watch.samples[0]["stack"])
    held = len(watch.samples)
    time.sleep(0.2)  # disarmed: nothing more
    assert len(watch.samples) == held
    watch.arm()  # a round that ends in time is not a stall
    telemetry.ends.append(bench.now())
    time.sleep(0.05)
    watch.disarm()
    assert watch.samples == []
    # A long stall leaves room for the next round's: at most `per_round` samples each.
    telemetry.ends.clear()
    watch = bench._StallWatch(telemetry, after_s=0.05, every_s=0.01, per_round=3)
    watch.arm()
    a_slow_place()
    telemetry.rounds.append(object())
    telemetry.ends.append(bench.now())
    a_slow_place()
    watch.disarm()
    assert [s["round"] for s in watch.samples] == [0, 0, 0, 1, 1, 1]


def test_stay_and_late_modes_warm_up_what_they_run(bench: ModuleType) -> None:
    src = types.SimpleNamespace(name="dspark")
    assert bench._StaySelector("dspark-stay", src, 7).sources() == {"dspark": src}
    assert bench._StaySelector("dspark-late3", src, 7, 3).sources() == {"dspark": src, "baseline": None}
    assert bench._StaySelector("baseline-capture").sources() == {"baseline": None}
