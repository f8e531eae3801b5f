"""Use case: the roofline — measured memory bandwidth and the model's bytes per token give the plain-decode
ceiling (every plain token reads every weight once); plain and speculative tok/s are measured against it.

Speculation verifies several tokens per weight read, so it can beat the plain ceiling; `vs_ceiling` says by
how much. KV-cache reads are left out of the bytes per token (small at the short prompts measured here).
Plain decoding cannot beat its own ceiling: when it measures above it, or the bandwidth samples spread
widely (a busy machine), or a lane's repeated runs do (each lane's tok/s is the median of its runs alone),
the result carries a warning saying which figure is not to be trusted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from mlx_dspark.application.dashboard.modes import ModeSet
from mlx_dspark.application.dashboard.ports import MachineProbe
from mlx_dspark.application.dashboard.race import NOISE_SPREAD, LaneDone, LaneTiming, RaceStatus, race
from mlx_dspark.application.generation import GenerationService

SPREAD_WARN = 1.5  # slowest / fastest bandwidth sample above which the machine was busy while measuring
ABOVE_CEILING_WARN = 1.1  # plain decoding this far above its ceiling: the ceiling is wrong, not the decoding
PROMPT = "Write a short Python function that returns the n-th Fibonacci number, then explain it in two sentences."


def measure(
    modes: ModeSet,
    served: GenerationService,
    probe: MachineProbe,
    lanes: Sequence[str],
    *,
    max_tokens: int = 48,
    bandwidth_bytes: int = 256 << 20,
    repeats: int = 2,
) -> Iterator[dict[str, Any]]:
    """Engine-thread job: status lines, then one result {bandwidth, model_bytes, ceiling_tok_s, lanes}; each
    lane's tok/s is the median of `repeats` runs alone, its spread beside it."""
    for mode in ("baseline", *lanes):  # fail before the benchmark when a mode cannot run here
        modes.get(served, mode)
    yield {"type": "status", "text": "measuring memory bandwidth (MLX copy)"}
    bw = probe.bandwidth(bandwidth_bytes)
    model_bytes = probe.model_bytes(served.model.handle)
    ceiling = bw["bytes_per_s"] / model_bytes if model_bytes else 0.0
    accepted: dict[str, float] = {}
    results = []
    for event in race(modes, served, PROMPT, lanes, max_tokens=max_tokens, repeats=repeats):
        if isinstance(event, LaneDone):
            accepted[event.mode] = event.mean_accepted
        elif isinstance(event, LaneTiming):
            results.append(
                {
                    "mode": event.mode,
                    "tok_s": event.median,
                    "samples_tok_s": list(event.samples),
                    "spread": event.spread,
                    "mean_accepted": accepted.get(event.mode, 0.0),
                    "vs_ceiling": event.median / ceiling if ceiling else 0.0,
                }
            )
            yield {"type": "status", "text": f"{event.mode}: {event.median:.1f} tok/s (median of {len(event.samples)})"}
        elif isinstance(event, RaceStatus):
            yield {"type": "status", "text": event.text}
    samples = [float(t) for t in bw.get("samples_s") or () if t > 0]
    spread = max(samples) / min(samples) if samples else 1.0
    yield {
        "type": "result",
        "warnings": warnings(spread, results),
        "bandwidth_spread": spread,
        "bandwidth_bytes_per_s": bw["bytes_per_s"],
        "bandwidth_samples_s": bw["samples_s"],
        "device": bw.get("device", ""),
        "model_bytes": model_bytes,
        "ceiling_tok_s": ceiling,
        "lanes": results,
    }


def warnings(spread: float, lanes: Sequence[dict[str, Any]]) -> list[str]:
    """What in a roofline result is noise: a spread-out bandwidth probe, plain decoding above its ceiling."""
    out = []
    if spread > SPREAD_WARN:
        out.append(
            f"the bandwidth samples spread {spread:.1f}x (slowest / fastest): the machine was busy, so the ceiling "
            "is unreliable; measure again when it is idle"
        )
    for lane in lanes:
        if lane.get("spread", 0.0) > NOISE_SPREAD:
            out.append(
                f"{lane['mode']}'s runs spread {lane['spread']:.0%} of their median: its tok/s is noise; measure "
                "again when the machine is idle"
            )
        if lane["mode"] == "baseline" and lane["vs_ceiling"] > ABOVE_CEILING_WARN:
            out.append(
                f"plain decoding measured {lane['vs_ceiling']:.2f}x its own ceiling, which it cannot reach: the "
                "bandwidth probe was disturbed (or the weights sit in a cache), so the ceiling is understated"
            )
    return out
