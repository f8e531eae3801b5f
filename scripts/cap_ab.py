"""A/B of the draft-cap policy in one process: plain decoding, then one mode under each policy, per prompt and
trial in turns (the same model object, source, calibrated curves and BLAS), so host noise hits all alike.

    .venv/bin/python scripts/cap_ab.py --model qwen2.5-coder-1.5b --mode draft --per-class 2 --max-tokens 64

Policies: `measured` (today's MeasuredCap), `leap` (the same without its growth bound: a decision may reach any
cap, the policy of 2026-12-07's afternoon), `flat` (the policy before 2026-12-07: positions past the cap start at
the flat prior, every block priced as if it filled its cap) and `fixed:N`. Prints one line per run and, per
policy, the median of its decode tok/s over plain decoding's on the same prompt and trial, and its tokens a
round. Lab tool; greedy, every output checked against plain decoding's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import attrs

from mlx_dspark.application.data import load_prompts, per_class
from mlx_dspark.application.generation import GenerationRequest
from mlx_dspark.application.modes import bench_runners
from mlx_dspark.domain.costmodel.acceptance import EwmaAcceptance, EwmaContinuation
from mlx_dspark.domain.costmodel.draft_cap import CapPolicy, FixedCap, MeasuredCap
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.entrypoints.cli.common import MODEL_FLAGS, start_with_model


class _FullBlocks(EwmaContinuation):
    """Never learns a stop: every block priced as if it filled its cap (the policy before 2026-12-07)."""

    def record(self, drafted: int, cap: int) -> None:
        return None


def _factory(name: str, measured: Callable[[], CapPolicy]) -> Callable[[], CapPolicy]:
    if name == "measured":
        return measured
    if name == "leap":

        def leap() -> CapPolicy:
            base = measured()
            assert isinstance(base, MeasuredCap)
            return attrs.evolve(base, grow_by=None)

        return leap
    if name.startswith("fixed:"):
        return lambda: FixedCap(int(name.split(":")[1]))
    if name == "flat":

        def flat() -> CapPolicy:
            base = measured()
            assert isinstance(base, MeasuredCap)
            n = max(base.max_cap, 1)
            return MeasuredCap(
                curves=base.curves,
                max_cap=base.max_cap,
                acceptance=EwmaAcceptance(positions=n, inherit=False),
                continuation=_FullBlocks(positions=n),
                grow_by=None,
            )

        return flat
    raise SystemExit(f"unknown policy {name}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--mode", default="draft")
    p.add_argument("--policies", default="measured,flat")
    p.add_argument("--prompts", default="heldout")
    p.add_argument("--per-class", type=int, default=2)
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    flags = {**dict.fromkeys(MODEL_FLAGS), "model": args.model, "trust_remote_code": False, "log_level": "warning"}
    settings, services, model = start_with_model(argparse.Namespace(**flags))
    runners = bench_runners(services, settings, model, ["baseline", args.mode], lambda m: None)
    plain, spec = runners["baseline"], runners[args.mode]
    measured = spec.selector.policy_factory
    assert measured is not None, "the mode needs calibrated curves (--max-draft auto)"
    selectors = {n: attrs.evolve(spec.selector, policy_factory=_factory(n, measured)) for n in args.policies.split(",")}
    prompts = per_class(load_prompts(args.prompts), args.per_class).prompts
    greedy = SamplingParams(temperature=0.0)

    def run(runner: Any, prompt: str, tokens: int) -> Any:
        model.target.reset(0)
        return runner.generate(GenerationRequest(prompt=prompt, max_tokens=tokens, sampling=greedy, prefix_cache=False))

    for sel in selectors.values():  # warm-up: every shape once
        spec.selector = sel
        run(spec, prompts[0].prompt, 8)
    run(plain, prompts[0].prompt, 8)
    ratios: dict[str, list[float]] = {n: [] for n in selectors}
    per_round: dict[str, list[float]] = {n: [] for n in selectors}
    drafted: dict[str, list[int]] = {n: [] for n in selectors}
    for trial in range(args.trials):
        for pr in prompts:
            base = run(plain, pr.prompt, args.max_tokens)
            order = list(selectors) if trial % 2 == 0 else list(reversed(selectors))
            for name in order:
                spec.selector = selectors[name]
                r = run(spec, pr.prompt, args.max_tokens)
                if r.token_ids != base.token_ids:
                    print(f"{pr.id} {name}: OUTPUT DIFFERS FROM PLAIN DECODING", file=sys.stderr)
                ratios[name].append(r.tokens_per_second / base.tokens_per_second)
                per_round[name].append(r.mean_accepted)
                drafted[name].append(r.drafted)
                print(
                    f"{pr.id} t{trial} {name}: {r.tokens_per_second:.2f} tok/s ({ratios[name][-1]:.2f}x plain "
                    f"{base.tokens_per_second:.2f}), {r.mean_accepted:.2f} a round, {r.drafted} drafted",
                    flush=True,
                )
    for name in selectors:
        print(
            f"{name}: {statistics.median(ratios[name]):.3f}x plain (median), "
            f"{statistics.mean(per_round[name]):.2f} tokens a round, {sum(drafted[name])} drafted",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
