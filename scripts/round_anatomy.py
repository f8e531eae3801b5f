"""Round anatomy (issue 26, item 4): what overlapping rounds could save, measured on bare mlx-lm forwards.

Lab tooling for a GPU slot (runs anywhere MLX does). Over one target (a random-weight shape, or the real export),
per verify width w = k + 1, one forward of w tokens after a cache that grows by w rows a round, greedy accepted
on the device (all drafts kept, so every round has the same shape as a fully accepted one):

  host_ms      building the forward's lazy graph (Python and MLX graph nodes; the device waits for it when the
               round is not overlapped)
  dispatch_ms  the host time of `mx.async_eval` on that graph (encoding its kernels; the H200 slot of 2026-12-03
               measured 8.1 ms of it in a DSpark round against 2.7 ms in a plain step)
  synced_ms    a round as the engine runs one today: build, dispatch, read the verdict back, then the next round,
               over cache lengths no earlier round had
  (per --caches kind: plain = mlx-lm's caches; bucketed = the engine's key-bucketed ones, whose wide forwards
  attend over a fixed key length per 256 rows, adapters/mlx/key_buckets.py; compiled = those with each wide
  forward replayed as one compiled graph, adapters/mlx/compiled_forward.py; rowwise = compiled, with every
  projection of a wide forward run as a batch of one-row products (`row_products`), the matrix-vector kernel a
  plain step uses instead of a cuBLAS GEMM: the H200 spent ~8 ms of dispatch on 8 rows against ~2.3 ms on one;
  skinny = compiled, with projections of 2..16 rows through the few-row CUDA kernel (`row_products.skinny`, opt-in):
  the weight read once for every row, one launch and no cuBLASLt call; fused, fused-<kind> = compiled or <kind>
  with q/k/v and gate/up fused into one product each (`fused_projections`): the model is fused in place when the
  first such kind runs, so name them last)
  repeat_ms    the same rounds again over the same cache lengths (every shape seen once): what a per-shape cost
               (kernel JIT, graph instantiation) adds is synced_ms - repeat_ms
  overlapped   the next round built and dispatched from the device-side verdict before this one is read (the
               ceiling of queueing the next round under "all accepted"), per round
  plain_ms     one pipelined plain step (mlx-lm's way), for the ratios

`ceiling_x` = w tokens per overlapped round against one plain step per token: what a drafter accepted in full
would give with overlap; `synced_x` the same without it.

    PYTHONPATH=$HOME/mlx-site:. python3 scripts/round_anatomy.py --shapes 0.6b,4b --widths 1,2,4,8 --json $OUT/ra.json
    PYTHONPATH=$HOME/mlx-site:. python3 scripts/round_anatomy.py --model $HOME/export --json $OUT/ra-real.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_bench as db  # the stand-ins for a bare device host, the shapes and the loaders
import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import make_prompt_cache

# importable once device_bench has mapped the checkout
from mlx_dspark.adapters.mlx import caches, fused_projections, row_products
from mlx_dspark.adapters.mlx.compiled_forward import CompiledForward

PROMPT = 64  # cached rows before the first round


_COMPILED: dict[tuple[int, str], CompiledForward] = {}  # per model and kind: the engine's compiled verify forward
_LINEAR = nn.Linear.__call__


def _rowwise(self: nn.Linear, x: mx.array) -> mx.array:
    """The engine's row products (`row_products.RowLinear`) for this module, switch or not, the kernel kept out."""
    checked, row_products._skinny_ok = row_products._skinny_ok, {}
    try:
        return row_products.project(self, x)
    finally:
        row_products._skinny_ok = checked


def _skinny(self: nn.Linear, x: mx.array) -> mx.array:
    """The engine's projection with the few-row kernel (checked for the dtype before the trace: `_forward`)."""
    return row_products.project(self, x)


_PATCHES = {"rowwise": _rowwise, "skinny": _skinny}


class _Unrecorded:
    rows: dict[int, mx.array] = {}  # noqa: RUF012 - never written: no layer is recorded here


def _forward(model: Any, tokens: mx.array, cache: Any, kind: str = "plain") -> mx.array:
    if kind in ("compiled", *_PATCHES) and CompiledForward.applies(cache, int(tokens.shape[0])):
        graph = _COMPILED.setdefault((id(model), kind), CompiledForward(model, lambda layers: _Unrecorded()))
        if kind == "skinny":  # as `row_products.install` does, outside any trace
            for dtype in {m.weight.dtype for _, m in model.named_modules() if type(m) is nn.Linear}:
                row_products.check_skinny(dtype)
        if kind in _PATCHES:  # the patch is live while the graph is traced (its first call per shape)
            nn.Linear.__call__ = _PATCHES[kind]
        try:
            logits = graph(tokens, cache, ())[0][0]
        finally:
            nn.Linear.__call__ = _LINEAR
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    logits = model(tokens[None], cache=cache)[0]
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def _fresh(model: Any, vocab: int, kind: str) -> tuple[Any, mx.array]:
    # bucketed, compiled: the engine's key-bucketed caches (key_buckets) instead of mlx-lm's own
    cache = make_prompt_cache(model) if kind == "plain" else caches.make_caches(model, buckets=True)
    prompt = mx.arange(PROMPT, dtype=mx.int32) % vocab
    out = _forward(model, prompt, cache)
    mx.eval(out)
    return cache, out[-1:]


def _tokens(last: mx.array, width: int) -> mx.array:
    # the anchor and width - 1 drafts derived on the device (values do not matter: every row is kept)
    return mx.concatenate([last, last + mx.arange(1, width, dtype=mx.int32)]) if width > 1 else last


def measure(model: Any, vocab: int, width: int, rounds: int, kind: str) -> dict[str, float]:
    """host, synced and overlapped ms per round of `width` tokens, and the pipelined plain step."""
    host: list[float] = []
    dispatch: list[float] = []
    synced: list[float] = []
    repeat: list[float] = []
    for timed in (synced, repeat):  # the second pass runs over the very same cache lengths
        cache, last = _fresh(model, vocab, kind)
        for _ in range(rounds):
            t0 = time.perf_counter()
            out = _forward(model, _tokens(last, width), cache, kind)
            t1 = time.perf_counter()
            mx.async_eval(out)
            t2 = time.perf_counter()
            out.tolist()  # the round's one host sync
            timed.append(time.perf_counter() - t0)
            if timed is synced:
                host.append(t1 - t0)
                dispatch.append(t2 - t1)
            last = out[-1:]
    cache, last = _fresh(model, vocab, kind)
    out = _forward(model, _tokens(last, width), cache, kind)
    mx.async_eval(out)
    t0 = time.perf_counter()
    for _ in range(rounds):
        nxt = _forward(model, _tokens(out[-1:], width), cache, kind)  # built from the device-side verdict
        mx.async_eval(nxt)
        out.tolist()  # read this round while the next one runs
        out = nxt
    out.tolist()
    overlapped = (time.perf_counter() - t0) / rounds
    return {
        "host_ms": 1e3 * statistics.median(host),
        "dispatch_ms": 1e3 * statistics.median(dispatch),
        "synced_ms": 1e3 * statistics.median(synced),
        "repeat_ms": 1e3 * statistics.median(repeat),
        "overlapped_ms": 1e3 * overlapped,
    }


def plain_ms(model: Any, vocab: int, steps: int, kind: str) -> float:
    cache, last = _fresh(model, vocab, kind)
    out = _forward(model, last, cache)
    mx.async_eval(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = _forward(model, out, cache)
        mx.async_eval(nxt)
        out.item()
        out = nxt
    out.item()
    return 1e3 * (time.perf_counter() - t0) / steps


def anatomy(model: Any, vocab: int, widths: Sequence[int], rounds: int, kind: str) -> dict[str, Any]:
    for w in widths:  # first shapes compile and allocate: warm each once
        measure(model, vocab, w, 3, kind)
    step = plain_ms(model, vocab, rounds, kind)
    rows = []
    for w in widths:
        m = measure(model, vocab, w, rounds, kind)
        rows.append(
            {
                "width": w,
                **{k: round(v, 3) for k, v in m.items()},
                "synced_x": round(w * step / m["synced_ms"], 3),
                "ceiling_x": round(w * step / m["overlapped_ms"], 3),
            }
        )
    return {"plain_ms": round(step, 3), "widths": rows}


def table(name: str, result: dict[str, Any]) -> str:
    head = "| width | host ms | dispatch ms | synced ms | repeat ms | overlapped ms | synced x | ceiling x |"
    lines = [f"### {name} (plain step {result['plain_ms']:.2f} ms)", "", head, "|---:" * 8 + "|"]
    for r in result["widths"]:
        lines.append(
            f"| {r['width']} | {r['host_ms']:.2f} | {r['dispatch_ms']:.2f} | {r['synced_ms']:.2f} "
            f"| {r['repeat_ms']:.2f} | {r['overlapped_ms']:.2f} | {r['synced_x']:.2f} | {r['ceiling_x']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="", help="random-weight shapes (0.6b,4b,8b,32b,hybrid)")
    p.add_argument("--model", help="the real export (scripts/device_bench.py export)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--widths", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=48)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke run)")
    p.add_argument("--caches", default="plain,bucketed,compiled,rowwise", help="cache kinds (see above), in this order")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    dtype = {"bf16": mx.bfloat16, "fp16": mx.float16, "fp32": mx.float32}[args.dtype]
    widths = [int(w) for w in args.widths.split(",") if w]
    doc: dict[str, Any] = {"device": str(mx.default_device()), "dtype": args.dtype, "results": {}}
    targets: list[tuple[str, Any]] = []
    if args.model:
        full = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[args.dtype]  # the loader's names
        targets.append(("real", lambda: db.load_module(Path(args.model), full)))
    for shape in [s for s in args.shapes.split(",") if s]:
        family, cfg = db.shape_config(shape, tiny=args.tiny)
        targets.append((shape, lambda family=family, cfg=cfg: db.random_model(family, cfg, dtype)))
    for name, build in targets:
        model = build()
        vocab = int(model.args.vocab_size) if hasattr(model.args, "vocab_size") else 1000
        for kind in [c for c in args.caches.split(",") if c]:
            if kind.startswith("fused"):
                fused_projections.fuse(model)  # the first time only: a fused model has no siblings left
            base = "compiled" if kind == "fused" else kind.removeprefix("fused-")
            result = anatomy(model, vocab, widths, args.rounds, base)
            doc["results"][f"{name}/{kind}"] = result
            sys.stdout.write(table(f"{name}, {kind} caches", result))
            sys.stdout.flush()
            if args.json:
                args.json.write_text(json.dumps(doc, indent=1))
        del model
        db.free_memory()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
