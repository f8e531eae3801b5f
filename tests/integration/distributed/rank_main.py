"""One rank of the distributed suite, started by `mlx.launch --backend ring` (see test_sharded.py).

argv: OUT_DIR FAMILY DSPARK_DIR DFLASH_DIR [chaos|hang]. Every rank builds the same tiny model, keeps its
tensor-parallel shard and wraps it in an MlxTargetModel; rank 0 decodes each prompt in every mode through a
MirroredTarget while the other ranks serve it; each rank then writes what it decoded and its cache's token ids.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, for tests.*

import mlx.core as mx

from mlx_dspark.adapters.mlx.distributed import Channel, MirroredTarget, serve_worker, shard
from mlx_dspark.adapters.mlx.draft_model import DraftModelSource
from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.engine import decode
from mlx_dspark.application.prefix_cache import PrefixCache, Reuse
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.errors import ModelUnavailable
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.decoding import collect
from tests.fakes.clock import FakeClock
from tests.fakes.tiny_models import tiny_model

PROMPTS = ((3, 17, 99, 5, 42), (7, 1, 150, 33, 8, 64, 2, 90, 11, 5, 130, 77))
BUDGETS = (40, 23)
DIE_AFTER = 30  # calls a worker serves in the chaos scenario before it dies


HANG_S = 12.0  # how long the hanging worker sleeps before it ends (so the launch itself ends)
RANK_TIMEOUT_S = 2.0  # rank 0's bound in the hang scenario


def chaos(rank: int, target: MlxTargetModel, channel: Channel, report: dict[str, object], hang: bool) -> None:
    """Rank 1 dies (or, with `hang`, stops answering with its sockets open) after DIE_AFTER calls, mid-request;
    rank 0 must end that request with a clear error, fast, and fail fast after it."""
    if rank != 0:
        header, calls = channel.header, [0]

        def dying(values: tuple[int, ...] = ()) -> list[int]:
            calls[0] += 1
            if calls[0] > DIE_AFTER:
                if hang:
                    time.sleep(HANG_S)
                os._exit(0)
            return header(values)

        channel.header = dying  # type: ignore[method-assign]
        serve_worker(target, channel)
        return
    mirrored = MirroredTarget(target, channel, timeout_s=RANK_TIMEOUT_S if hang else None)
    events = decode(mirrored, [3, 17, 99], SamplingParams(), StopRule(max_tokens=500), FakeClock())
    start, got = time.perf_counter(), 0
    try:
        for event in events:
            got += len(getattr(event, "tokens", ()))
    except ModelUnavailable as exc:
        report.update(error=exc.message, seconds=time.perf_counter() - start, tokens=got)
    try:
        mirrored.reset(0)
    except ModelUnavailable as exc:
        report["after"] = exc.message


def prefix_turns(mirrored: MirroredTarget) -> dict[str, object]:
    """A second turn served from the prefix cache over the shards equals the same prompt cold; a cache that can
    keep one state evicts the older ones, which every rank then drops."""
    mirrored.configure_capture(())  # plain decoding: the state holds no features
    cold: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int], cache: PrefixCache | None, budget: int = 12) -> tuple[list[int], str]:
        reuse = cache.prepare(mirrored, prompt) if cache is not None else Reuse(rows=mirrored.reset(0), source="none")
        stop = StopRule(max_tokens=budget)
        events = decode(mirrored, prompt, SamplingParams(), stop, FakeClock(), reuse_prefix=reuse.rows)
        tokens = collect(events)[0]
        if cache is not None:
            cache.remember(mirrored)
        return tokens, reuse.source

    first = list(PROMPTS[1])
    turn1, _ = run(first, None)
    second = [*first, *turn1, 5, 9]
    cold[tuple(second)], _ = run(second, None)
    cache = PrefixCache(1 << 30)
    run(first, cache)
    run(list(PROMPTS[0]), cache)  # another conversation in between: the live rows are no longer the first's
    warm, source = run(second, cache)
    one = mirrored.save_state().nbytes
    small = PrefixCache(int(one * 1.5))
    for prompt in (PROMPTS[0], PROMPTS[1], second, PROMPTS[0]):
        run(list(prompt), small)
    del cache
    gc.collect()  # the radix tree's nodes form cycles: their states go with the cyclic collector
    mirrored.reset(0)  # one more call: every rank drops what the caches let go
    return {"warm": warm, "cold": cold[tuple(second)], "source": source, "kept": len(small.entries(mirrored.state_tag))}


def main() -> None:
    out, family, dspark_dir, dflash_dir = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    group = mx.distributed.init(backend="ring", strict=True)
    rank = group.rank()
    model = shard(tiny_model(family, seed=0), group)
    target = MlxTargetModel(model)
    channel = Channel(group)
    report: dict[str, object] = {"rank": rank, "size": group.size()}
    if sys.argv[5:] in (["chaos"], ["hang"]):
        hang = sys.argv[5] == "hang"
        chaos(rank, target, channel, report, hang)
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        if hang and rank == 0:  # its link thread is stuck in the hung all-reduce: end without waiting on it
            os._exit(0)
        return
    if rank != 0:
        states: dict[int, object] = {}
        report["served"] = serve_worker(target, channel, states)
        report["states_left"] = len(states)
    else:
        mirrored = MirroredTarget(target, channel)
        sources = {
            "plain": None,
            "lookup": LookupDraftSource(block=6, min_n=1),
            "dspark": load_drafter("dspark", dspark_dir, model, bits=0),
            "dflash": load_drafter("dflash", dflash_dir, model, bits=0),
            "draft": DraftModelSource(tiny_model("llama", seed=5)),
        }
        runs: dict[str, list[list[int]]] = {}
        rounds: dict[str, list[int]] = {}
        seconds: dict[str, float] = {}
        for name, source in sources.items():
            if source is not None and source.uses_features:
                mirrored.configure_capture(tuple(source.target_layer_ids))
            start = time.perf_counter()
            runs[name], rounds[name] = [], []
            for prompt, budget in zip(PROMPTS, BUDGETS):
                events = decode(
                    mirrored, list(prompt), SamplingParams(), StopRule(max_tokens=budget), FakeClock(),
                    source=source, cap_policy=FixedCap(4) if source is not None else None,
                )  # fmt: skip
                tokens, rs, _ = collect(events)
                runs[name].append(tokens)
                rounds[name].append(len(rs))
            seconds[name] = time.perf_counter() - start
        # Sampled: rank 0 draws every uniform and sends it with the call, so every rank accepts alike.
        sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=3)

        def sampled_run() -> list[int]:
            stop, cap = StopRule(max_tokens=30), FixedCap(4)
            events = decode(
                mirrored, list(PROMPTS[0]), sampled, stop, FakeClock(), source=sources["lookup"], cap_policy=cap
            )
            return collect(events)[0]

        report["sampled"] = [sampled_run(), sampled_run()]
        report["prefix"] = prefix_turns(mirrored)
        mirrored.stop()
        report.update(runs=runs, rounds=rounds, seconds=seconds)
    report["cached_ids"] = list(target.cached_ids)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
