"""`--mode auto` replayed on real rounds: the AutoSelector (its forecasts, cost book, priors and start
choice) drives 12 held-out requests whose every round comes from a recording of each fixed mode on the
default model (`data/heldout_rounds.json`, written by `scripts/auto_traces.py`, with the race and the
calibrated curves of the same run; greedy output is the same in every mode, so the recordings line up by
token position, and the switcher sees the committed history as the decode loop shows it, so lookup's
rounds are replayed from it). Per class, auto's throughput must stay close to the best fixed mode's and
above plain decoding's, in the recorded order and in shuffled ones.

The replay is deterministic (no clock): a round of source S at position p is S's recorded round that
started nearest before p, plus a switch cost on the first round of a stint (what the real runs showed:
a drafter catching up on the rows it missed). Cap policies do not figure: the recordings carry each
fixed mode's own caps, which is what auto's fresh per-request policies run.
"""

from __future__ import annotations

import bisect
import json
import random
import statistics
from pathlib import Path
from typing import Any

import attrs

from mlx_dspark.application.auto_mode import AutoSelector, cap_policy_factory
from mlx_dspark.domain.costmodel.curves import CostCurves
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.drafting.selection import PLAIN
from mlx_dspark.domain.events import Usage

DATA = json.loads((Path(__file__).parent / "data" / "heldout_rounds.json").read_text())
MODES = ("baseline", "dspark", "dflash", "lookup")
SWITCH_S = {"baseline": 0.010, "dspark": 0.015, "dflash": 0.040, "lookup": 0.0}  # measured in the real runs


@attrs.frozen
class _Source:
    """Stands in for a draft source: the selector reads only its block size."""

    name: str
    max_block: int = 7


def _curves(raw: dict[str, Any]) -> CostCurves:
    return CostCurves(
        verify_s={int(k): v for k, v in raw["verify_s"].items()},
        draft_s={int(k): v for k, v in raw["draft_s"].items()},
        slope_s_per_token=raw["slope_s_per_token"],
        overhead_s=raw["overhead_s"],
    )


def _selector() -> AutoSelector:
    candidates: dict[str, Any] = {m: (None if m == PLAIN else _Source(m)) for m in MODES}
    candidates["lookup"] = LookupDraftSource(block=8)  # its rounds are replayed from the history
    policies = {m: cap_policy_factory(7, None, 7) for m in MODES if m != PLAIN}
    curves = {m: _curves(c) for m, c in DATA["curves"].items()}
    return AutoSelector(candidates, policies, DATA["race_tok_s"], curves=curves)


def _positions(rounds: list[list[float]]) -> tuple[list[int], list[tuple[int, float, int]]]:
    starts, out, pos = [], [], 0
    for committed, ms, drafted in rounds:
        starts.append(pos)
        out.append((max(1, int(committed)), ms / 1000, int(drafted)))
        pos += int(committed)
    return starts, out


def replay(selector: AutoSelector, prompt: dict[str, Any]) -> float:
    """One request through the selector on recorded rounds; its decode tok/s."""
    traces = {m: _positions(prompt["rounds"][m]) for m in MODES}
    total = sum(int(c) for c, _, _ in prompt["rounds"][PLAIN])
    # The prompt, the first token (from the prefill), then every round's; an EOS is counted, not shown.
    history = list(prompt["prompt_ids"]) + list(prompt["ids"])
    first = len(prompt["prompt_ids"]) + 1
    selection = selector.select(prompt["prompt_ids"])
    switcher = selection.switcher
    assert switcher is not None
    name, last, pos, seconds = selection.name, None, 0, 0.0
    while pos < total:
        starts, rounds = traces[name]
        tokens, s, drafted = rounds[max(0, bisect.bisect_right(starts, pos) - 1)]
        tokens = min(tokens, total - pos)
        s += SWITCH_S[name] if last not in (None, name) else 0.0
        last = name
        pos, seconds = pos + tokens, seconds + s
        seen = history[: min(first + pos, len(history))]
        nxt = switcher.after_round(name, tokens, s, drafted=drafted, history=seen)
        if nxt is not None and pos < total:
            name = nxt.name
    selector.finished(selection, Usage(prompt_tokens=len(prompt["prompt_ids"]), generated_tokens=total, source=name))
    return total / seconds


def fixed_rate(prompt: dict[str, Any], mode: str) -> float:
    rounds = prompt["rounds"][mode]
    return sum(int(c) for c, _, _ in rounds) / sum(ms for _, ms, _ in rounds) * 1000


def per_class(prompts: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per class: auto's median tok/s ÷ the best fixed mode's median, and ÷ plain decoding's."""
    selector = _selector()
    rates = [(p["cls"], replay(selector, p), {m: fixed_rate(p, m) for m in MODES}) for p in prompts]
    out = {}
    for cls in sorted({c for c, _, _ in rates}):
        rows = [(a, f) for c, a, f in rates if c == cls]
        auto = statistics.median(a for a, _ in rows)
        fixed = {m: statistics.median(f[m] for _, f in rows) for m in MODES}
        out[cls] = (auto / max(fixed.values()), auto / fixed[PLAIN])
    return out


def test_auto_on_recorded_rounds_stays_near_the_best_fixed_mode() -> None:
    prompts = DATA["prompts"]
    assert len(prompts) == 12 and {p["cls"] for p in prompts} == {"chat", "code", "math"}
    orders = [prompts] + [random.Random(seed).sample(prompts, len(prompts)) for seed in range(12)]
    results = [per_class(order) for order in orders]
    for cls in ("chat", "code", "math"):
        vs_best = [r[cls][0] for r in results]
        vs_plain = [r[cls][1] for r in results]
        # First looks and switches cost a few per cent; a rule that probed every candidate on every prompt
        # (the earlier one: 0.97 / 0.93 / 0.91 here) or stuck on a loser falls below.
        assert statistics.mean(vs_best) >= 0.95, (cls, vs_best)
        assert min(vs_best) >= 0.9, (cls, vs_best)
        assert min(vs_plain) >= 1.0, (cls, vs_plain)
