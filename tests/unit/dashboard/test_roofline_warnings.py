"""The roofline says when its figures are noise: a spread-out bandwidth probe, plain decoding above its own
ceiling (it once reported plain decoding at 2.21x its ceiling with no word of warning), a lane whose repeated
runs spread widely."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from mlx_dspark.application.dashboard import roofline
from mlx_dspark.application.dashboard.race import LaneDone, LaneTiming


class Probe:
    def __init__(self, samples: list[float]) -> None:
        self.samples = samples

    def bandwidth(self, size_bytes: int = 0, repeats: int = 7) -> dict[str, Any]:
        return {"bytes_per_s": 1e9 / min(self.samples), "samples_s": self.samples, "device": "CPU (x86_64)"}

    def model_bytes(self, handle: Any) -> int:
        return 100_000_000  # 1 GB/s over 100 MB: a 10 tok/s ceiling at the fastest sample


class Modes:
    def get(self, served: Any, mode: str) -> Any:
        return served


class Served:
    class model:  # noqa: N801 - stands in for LoadedModel
        handle = None


def result(
    monkeypatch: Any, samples: list[float], plain_tok_s: float, *, runs: tuple[float, ...] = (1.0,), repeats: int = 2
) -> dict[str, Any]:
    """The roofline's result over a race whose lanes ran `repeats` times alone at `runs` times their rate."""

    def race(modes: Any, served: Any, prompt: str, lanes: Any, *, max_tokens: int, repeats: int) -> Iterator[Any]:
        for mode, tok_s in (("baseline", plain_tok_s), ("dspark", 3 * plain_tok_s)):
            spec = mode != "baseline"
            yield LaneDone(mode=mode, tokens=48, tok_s=tok_s / 2, mean_accepted=3.0 if spec else 1.0,
                           drafted=64 if spec else 0, accepted=32 if spec else 0, finish_reason="length")  # fmt: skip
        for mode, tok_s in (("baseline", plain_tok_s), ("dspark", 3 * plain_tok_s)):
            yield LaneTiming(mode=mode, samples=tuple(tok_s * r for r in runs[:repeats]))

    monkeypatch.setattr(roofline, "race", race)
    events = list(roofline.measure(Modes(), Served(), Probe(samples), ["dspark"], repeats=repeats))  # type: ignore[arg-type]
    return events[-1]


def test_a_quiet_measurement_has_no_warning(monkeypatch: Any) -> None:
    r = result(monkeypatch, [1.0, 1.05, 1.1], plain_tok_s=9.0)
    assert r["warnings"] == [] and r["ceiling_tok_s"] == 10.0 and r["device"] == "CPU (x86_64)"
    assert [lane["vs_ceiling"] for lane in r["lanes"]] == [0.9, 2.7]  # speculation may beat the ceiling


def test_plain_decoding_above_its_ceiling_is_flagged(monkeypatch: Any) -> None:
    (warning,) = result(monkeypatch, [1.0, 1.05, 1.1], plain_tok_s=22.1)["warnings"]
    assert "2.21x its own ceiling" in warning and "understated" in warning


def test_a_busy_machine_is_flagged(monkeypatch: Any) -> None:
    (warning,) = result(monkeypatch, [1.0, 2.5, 1.1], plain_tok_s=9.0)["warnings"]
    assert "spread 2.5x" in warning and "busy" in warning


def test_each_lane_is_the_median_of_its_solo_runs_and_a_wide_spread_is_flagged(monkeypatch: Any) -> None:
    r = result(monkeypatch, [1.0, 1.05, 1.1], plain_tok_s=9.0, runs=(0.8, 1.0, 1.2), repeats=3)
    assert [lane["tok_s"] for lane in r["lanes"]] == [9.0, 27.0]  # the medians, not the side-by-side rates
    assert r["lanes"][0]["samples_tok_s"] == pytest.approx([7.2, 9.0, 10.8])
    assert [lane["mean_accepted"] for lane in r["lanes"]] == [1.0, 3.0]
    assert len(r["warnings"]) == 2 and all("spread 40% of their median" in w for w in r["warnings"])
