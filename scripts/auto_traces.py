"""Record per-round traces of each fixed mode (and auto's own run) on the held-out prompts, for tuning the
auto rule (`domain/costmodel/forecast.py`) offline on real rounds instead of a 15-minute bench per try.

Per prompt and mode, one greedy request from an empty cache: every round's committed tokens (an EOS that
ends the request counts, as the decode loop reports it to auto), wall seconds between consecutive round
ends (the caller's share included, what auto measures) and its source; for auto, every SourceSwitched
with its reason. Greedy output is the same in every mode, so the traces line up by token position.

    .venv/bin/python scripts/auto_traces.py --out traces.json [--per-class 4] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from mlx_dspark.application.data import load_prompts, per_class
from mlx_dspark.application.generation import GenerationRequest
from mlx_dspark.application.modes import bench_runners
from mlx_dspark.domain.events import Finished, RoundFinished, SourceSwitched
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.entrypoints.cli.common import MODEL_FLAGS, start_with_model


class _Recorder:
    """A telemetry sink that keeps this request's rounds and switches, timed on arrival."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.events: list[tuple[float, Any]] = []

    def emit(self, request_id: str, event: object) -> None:
        self.events.append((time.perf_counter(), event))
        self.inner.emit(request_id, event)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _trace(events: list[tuple[float, Any]], start: float) -> dict[str, Any]:
    rounds, switches = [], []
    last = start
    for t, ev in events:
        if isinstance(ev, RoundFinished):
            rounds.append(
                {
                    "source": ev.source,
                    "committed": ev.committed,
                    "drafted": ev.drafted,
                    "accepted": ev.accepted,
                    "seconds": t - last,
                    "depth": ev.depth,
                }
            )
            last = t
        elif isinstance(ev, SourceSwitched):
            switches.append({"round": len(rounds), "old": ev.old, "new": ev.new, "reason": ev.reason})
        elif isinstance(ev, Finished) and rounds and ev.reason.value == "stop":
            rounds[-1]["committed"] += 1  # the EOS: auto counts it for the round that produced it
    return {"rounds": rounds, "switches": switches}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", default="heldout")
    p.add_argument("--per-class", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--modes", default="baseline,dspark,dflash,lookup,auto")
    p.add_argument("--model", default="default")
    args = p.parse_args()
    flags = {**dict.fromkeys(MODEL_FLAGS), "model": args.model, "trust_remote_code": False, "log_level": "warning"}
    ns = argparse.Namespace(**flags)
    settings, services, model = start_with_model(ns)
    modes = args.modes.split(",")
    runners = bench_runners(services, settings, model, modes, lambda m: None)
    prompts = per_class(load_prompts(args.prompts), args.per_class).prompts
    greedy = SamplingParams(temperature=0.0)
    for runner in runners.values():  # warm-up: shapes and the auto race
        model.target.reset(0)
        runner.generate(GenerationRequest(prompt=prompts[0].prompt, max_tokens=8, sampling=greedy, prefix_cache=False))
    out: dict[str, Any] = {"model": model.identity, "max_tokens": args.max_tokens, "prompts": []}
    for pr in prompts:
        request = GenerationRequest(prompt=pr.prompt, max_tokens=args.max_tokens, sampling=greedy, prefix_cache=False)
        prompt_ids = next(iter(runners.values())).encode_prompt(request)
        entry: dict[str, Any] = {"id": pr.id, "cls": pr.cls, "prompt_ids": prompt_ids, "modes": {}}
        for mode, runner in runners.items():
            model.target.reset(0)
            rec = _Recorder(runner._telemetry)
            runner._telemetry = rec
            try:
                start = time.perf_counter()
                r = runner.generate(request)
            finally:
                runner._telemetry = rec.inner
            # the first round's clock starts when decoding does (after prefill)
            first = start + r.time_to_first_token_s
            tr = _trace(rec.events, first)
            tr.update(tok_s=r.tokens_per_second, tokens=r.generated_tokens, ids=r.token_ids)
            entry["modes"][mode] = tr
            sys.stderr.write(
                f"{pr.id} {mode}: {r.tokens_per_second:.2f} tok/s, {len(tr['rounds'])} rounds, "
                f"{len(tr['switches'])} switches\n"
            )
        out["prompts"].append(entry)
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
