"""`mlx-dspark bench`, `calibrate` and `doctor` on fakes: the commands parse, call the application's mode
selection and render; auto runs beside the fixed modes and the table has a column per prompt class; doctor's
cost lines come from the timed fakes' known costs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.ports import DraftSource
from mlx_dspark.entrypoints.cli import bench, calibrate, doctor
from tests.fakes.clock import RecordingTelemetrySink
from tests.integration.calibration.timed_fakes import ManualClock, MemoryStore, TimedSource, TimedTarget, flat, loaded


class FakeLoader:
    """One timed target; "lookup" drafts right and cheaply, "dspark" drafts right but slowly."""

    def __init__(self) -> None:
        self.clock = ManualClock(tick=1e-6)
        self.target = TimedTarget(self.clock, flat(0.05))

    def load_target(self, name: str) -> LoadedModel:
        return loaded(self.target)

    def load_drafter(self, kind: str, spec: str | None, model: LoadedModel, *, bits: int | None) -> DraftSource:
        cost = 0.001 if kind == "lookup" else 0.4
        return TimedSource(self.target, lambda cap: cost, block=4, name=kind)

    def available_drafters(self, model: LoadedModel) -> list[str]:
        return ["lookup", "dspark"]


@pytest.fixture
def fake_start(monkeypatch: pytest.MonkeyPatch) -> Any:
    loader = FakeLoader()
    settings = load_settings({"model": "fake"}, {})
    services = bootstrap.build(
        settings, loader=loader, clock=loader.clock, telemetry=RecordingTelemetrySink(), calibration=MemoryStore()
    )

    def start(args: Any, *_: Any) -> tuple[Any, Any, LoadedModel]:
        return settings, services, loader.load_target("fake")

    monkeypatch.setattr(bench, "start_with_model", start)
    monkeypatch.setattr(calibrate, "start_with_model", start)
    monkeypatch.setattr(doctor, "start", lambda *_a, **_k: services)
    return services


def test_bench_runs_auto_beside_the_fixed_modes(fake_start: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench.main(["--modes", "lookup,auto", "--prompts", "chat,code", "--trials", "1", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    header = lines[1].split()
    assert header[:1] == ["mode"] and "chat" in header and "code" in header and "ran" in header
    end = next(i for i, line in enumerate(lines) if line.startswith("auto per class"))
    rows = {line.split()[0]: line for line in lines[3:end] if line.strip()}
    assert set(rows) == {"baseline", "lookup", "auto"}  # the baseline always runs, first
    assert "yes" in rows["auto"] and "yes" in rows["lookup"]
    # Then auto per class against plain decoding and the best fixed mode.
    verdicts = {line.split()[0] for line in lines[end + 3 :] if line.strip()}
    assert verdicts == {"chat", "code"} and "auto/best" in lines[end + 1]


def test_calibrate_races_the_sources_auto_would(fake_start: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rc = calibrate.main(["--race-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    raced = {line.split()[0] for line in out.splitlines() if " race " in line}
    assert raced == {"baseline", "lookup", "dspark"}
    assert out.rstrip().endswith("auto mode picks: lookup")


def test_doctor_reports_step_verify_drafter_and_round_overhead(
    fake_start: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert doctor.main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # The fake charges 0.05 s + 0.5 ms per row for a forward; lookup 1 ms and dspark 400 ms per draft.
    assert out["step_ms"] == pytest.approx(50.5, rel=1e-3)
    assert set(out["verify_ms"]) == {"1", "2", "4", "8", "16"}
    assert out["verify_ms"]["8"] == pytest.approx(54.0, rel=1e-3)
    rounds = out["rounds"]
    assert set(rounds) == {"plain", "lookup", "dspark"}
    assert rounds["lookup"]["per_draft_ms"] == pytest.approx(1.0, rel=1e-2)
    assert rounds["dspark"]["per_draft_ms"] == pytest.approx(400.0, rel=1e-3)
    assert 0 < rounds["dspark"]["draft_ms"] <= rounds["dspark"]["per_draft_ms"]  # a last round may not draft
    for r in rounds.values():
        assert r["rounds"] > 0
        assert r["round_ms"] == pytest.approx(r["verify_ms"] + r["draft_ms"] + r["overhead_ms"], abs=2e-3)
        # Only the manual clock's 1 µs readings fall outside draft and verify.
        assert 0 < r["overhead_ms"] < 0.05 and r["overhead_share_of_step"] < 1e-3
    assert rounds["lookup"]["drafted_per_round"] > 0 and rounds["plain"]["drafted_per_round"] == 0
    assert out["warnings"] == []  # the fake's costs agree with each other
    assert doctor.main([]) == 0
    text = capsys.readouterr().out
    for label in ("plain step", "verify cost", "drafter       lookup", "drafter       dspark", "round overhead"):
        assert label in text
    assert text.index("device ") < text.index("plain step")  # what is known at once is printed first


def test_doctor_says_when_its_timings_contradict_themselves() -> None:
    report = {
        "step_ms": 25.0,
        "verify_ms": {"1": 10.0, "2": 11.0, "4": 6.0, "8": 14.0},
        "rounds": {"plain": {"rounds": 5}, "dspark": {"rounds": 4, "round_ms": 5.0, "verify_ms": 12.0}},
    }
    warnings = doctor.noise_warnings(report, load=3.5)
    assert any("verify of 4 tokens measured 6.00 ms, below 2 tokens' 11.00 ms" in w for w in warnings)
    assert any("plain step measured 25.00 ms against a one-token verify's 10.00 ms" in w for w in warnings)
    assert any("dspark round measured 5.00 ms, below its own verify's 12.00" in w for w in warnings)
    assert all("load average 3.5" in w for w in warnings[:-1]) and "idle" in warnings[-1]
    calm = {"step_ms": 10.0, "verify_ms": {"1": 10.0, "2": 10.5}, "rounds": {"plain": {"rounds": 5}}}
    assert doctor.noise_warnings(calm, load=0.2) == []
