"""Lab bench (issue 31): speculation over a sharded target against the same on one machine.

    python scripts/distributed_bench.py --json one.json                          # one process
    mlx.launch --backend ring -n 2 --python .venv/bin/python scripts/distributed_bench.py --json two.json

Every rank builds the same random llama (`--hidden`, `--layers`; float32) and keeps its tensor-parallel shard;
rank 0 decodes `--tokens` tokens plainly, then with an oracle source that proposes the plain run's own next
`cap` tokens (every draft accepted: tau = cap + 1), through the mirrored target. It prints and writes time per
round, tokens per round and the speed-up of each cap over plain decoding, plus the mirrored call's round trip.
The speed-up when sharded is the figure to set beside the one-machine speed-up: a verify pays the link once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_dspark.adapters.mlx.blas import ensure_fast_blas

ensure_fast_blas()  # before MLX loads, as the CLI does: a reference BLAS makes a k-token verify cost k steps

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from mlx_dspark.adapters.mlx.distributed import Channel, MirroredTarget, serve_worker, shard  # noqa: E402
from mlx_dspark.adapters.mlx.target import MlxTargetModel  # noqa: E402
from mlx_dspark.application.engine import decode  # noqa: E402
from mlx_dspark.domain.costmodel.draft_cap import FixedCap  # noqa: E402
from mlx_dspark.domain.drafting.block import DraftBlock  # noqa: E402
from mlx_dspark.domain.events import Finished, RoundFinished, TokensCommitted  # noqa: E402
from mlx_dspark.domain.tokens import SamplingParams, StopRule  # noqa: E402


class Oracle:
    """Proposes the plain run's next tokens: every draft is right (forced acceptance)."""

    name = "oracle"
    uses_features = False

    def __init__(self, prompt: list[int], continuation: list[int], block: int) -> None:
        self.sequence = [*prompt, *continuation]
        self.block = block

    @property
    def max_block(self) -> int:
        return self.block

    def begin(self, prompt: list[int]) -> None:
        pass

    def propose(self, ctx, cap, sampling, uniforms):  # type: ignore[no-untyped-def]
        start = len(ctx.history)
        return DraftBlock(tokens=tuple(self.sequence[start : start + min(cap, self.block)]), source=self.name)


def model(hidden: int, layers: int, vocab: int) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=4 * hidden,
        num_attention_heads=hidden // 64, num_key_value_heads=max(2, hidden // 128), rms_norm_eps=1e-6,
        vocab_size=vocab, head_dim=64, tie_word_embeddings=False, rope_theta=10000.0,
    )  # fmt: skip
    mx.random.seed(0)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def run(target, prompt, tokens, source=None, cap=0):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    out, rounds = [], 0
    events = decode(
        target, prompt, SamplingParams(), StopRule(max_tokens=tokens), _Clock(),
        source=source, cap_policy=FixedCap(cap) if source else None,
    )  # fmt: skip
    for ev in events:
        if isinstance(ev, TokensCommitted):
            out.extend(ev.tokens)
        elif isinstance(ev, RoundFinished):
            rounds += 1
        elif isinstance(ev, Finished):
            pass
    return out, rounds, time.perf_counter() - start


class _Clock:
    def now(self) -> float:
        return time.perf_counter()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--caps", default="3,7")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    group = mx.distributed.init(backend="ring", strict=False)
    target = MlxTargetModel(shard(model(args.hidden, args.layers, args.vocab), group))
    channel = Channel(group)
    if group.rank() != 0:
        serve_worker(target, channel)
        return
    t = MirroredTarget(target, channel) if group.size() > 1 else target
    prompt = [(7 * i) % args.vocab for i in range(32)]
    run(t, prompt, 8)  # first shapes
    plain, plain_rounds, _ = run(t, prompt, args.tokens)
    result = {"ranks": group.size(), "hidden": args.hidden, "layers": args.layers, "tokens": args.tokens}
    if isinstance(t, MirroredTarget):
        result["call_round_trip_ms"] = round(t.ping() * 1e3, 3)
    times = {"plain": statistics.median(run(t, prompt, args.tokens)[2] for _ in range(args.repeats))}
    result["plain_ms_per_round"] = round(times["plain"] / plain_rounds * 1e3, 3)
    for cap in (int(c) for c in args.caps.split(",")):
        oracle = Oracle(prompt, plain, cap)
        runs = [run(t, prompt, args.tokens, oracle, cap) for _ in range(args.repeats)]
        assert all(r[0] == plain for r in runs), "speculation changed the output"
        seconds, rounds = statistics.median(r[2] for r in runs), runs[0][1]
        result[f"cap{cap}"] = {
            "tokens_per_round": round(args.tokens / rounds, 2),
            "ms_per_round": round(seconds / rounds * 1e3, 3),
            "speedup_vs_plain": round(times["plain"] / seconds, 2),
        }
    if isinstance(t, MirroredTarget):
        t.stop()
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
