"""Where a lock-step generation step goes on the device: the target's forward, then each sampler variant.

    python3 scripts/gen_profile.py --model $HOME/target [--batches 1024,2048] [--span 384] [--dtype bfloat16]

Fills every row's cache to `span` keys with random values (the timing does not depend on them), then times
(median of `--reps`, each step evaluated alone): the forward of one token per row, and the forward followed by
the greedy argmax, the sampler without a nucleus cut, and the sampler with one (the vocabulary sort). Prints
one JSON line per batch: ms per step and the tok/s each would give if every row were busy. Lab tool for the
data call of a slot (`gpu_slot.sh data`): `--top-p-choices 1.0` skips the nucleus.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="1024,2048")
    p.add_argument("--span", type=int, default=384)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=8)
    a = p.parse_args()

    import mlx.core as mx
    from gpu_distill import load_target

    model = load_target(Path(a.model), a.dtype)
    for b in (int(x) for x in a.batches.split(",")):
        print(json.dumps(profile_batch(model, b, a.span, a.reps, a.dtype)), flush=True)
        mx.clear_cache()


def profile_batch(model: object, b: int, span: int, reps: int, dtype: str) -> dict[str, object]:
    """Median milliseconds of one step of `b` rows over `span` keys, per kind of step."""
    import mlx.core as mx

    from mlx_dspark.adapters.mlx.training import generate as g

    rows = g._Rows(mx.full((b,), span - 1, dtype=mx.int32), span, prefill=False)
    caches = g._decoder_caches(model, rows, span)
    tokens = mx.random.randint(0, 1000, (b,)).astype(mx.int32)
    g._step_logits(model, tokens, caches)  # allocates every cache row
    for c in caches:
        assert c.keys is not None and c.values is not None
        c.keys = mx.random.normal(c.keys.shape).astype(c.keys.dtype)
        c.values = mx.random.normal(c.values.shape).astype(c.values.dtype)
    mx.eval([c.state for c in caches])
    temps = mx.array([0.0 if i % 5 < 3 else 0.8 for i in range(b)], dtype=mx.float32)  # 60 % greedy
    tops = mx.array([0.9] * b, dtype=mx.float32)
    key = mx.random.key(0)

    def step(kind: str) -> float:
        t = time.perf_counter()
        logits = g._step_logits(model, tokens, caches)
        if kind == "forward":
            out = logits
        elif kind == "greedy":
            out = mx.argmax(logits.astype(mx.float32), axis=-1)
        else:
            out = g.sample_rows(logits, temps, tops, key, nucleus=kind == "nucleus")
        mx.eval(out, [c.state for c in caches])
        return time.perf_counter() - t

    report: dict[str, object] = {"batch": b, "span": span, "dtype": dtype, "device": str(mx.default_device())}
    for kind in ("forward", "greedy", "plain", "nucleus"):
        for _ in range(2):
            step(kind)
        ms = statistics.median(step(kind) for _ in range(reps)) * 1e3
        report[f"{kind}_ms"] = round(ms, 2)
        report[f"{kind}_tok_s"] = round(b / ms * 1e3)
    return report


if __name__ == "__main__":
    main()
