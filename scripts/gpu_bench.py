"""Prefill and plain-decode tok/s of mlx-dspark's decode loop against mlx-lm's `generate_step`, one process,
one device (written for MLX CUDA on an H200; runs anywhere MLX does).

Self-contained: needs only `mlx`, `mlx_lm` and `mlx_dspark` importable (no tokenizer, no registry, no hub).
Prompts are fixed pseudo-random token ids; decoding is greedy with no EOS, so both sides produce exactly
`--decode-tokens` tokens, and their token ids are compared. mlx-lm is timed by
`mlx_dspark.adapters.mlx.mlx_lm_reference`, the same code as `mlx-dspark bench --against mlx-lm`.
Each measurement alternates ours / mlx-lm and reports medians and the paired ratio ours / mlx-lm (> 1 = ours faster).

    PYTHONPATH=$HOME/mlx-site:CODE_DIR python3 scripts/gpu_bench.py --model MODEL_DIR [--json FILE]

MODEL_DIR is an mlx-lm checkpoint directory (config.json + *.safetensors, quantized or not), or an
export whose config.json lists `quantized_modules` with a `target.safetensors` (kept quantized here).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.abc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any


class _Inert(type):
    """A stub class: any public attribute is a function that does nothing (`AutoTokenizer.register(...)`)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


class _TransformersStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`transformers` and any submodule of it as empty modules whose public names are inert classes."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "transformers" and not name.startswith("transformers."):
            return None
        return importlib.util.spec_from_loader(name, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def attribute(name: str) -> type:
            if name.startswith("_"):
                raise AttributeError(name)
            return _Inert(name, (), {})

        module.__getattr__ = attribute  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _import_mlx_lm_generate() -> Any:
    """mlx-lm's generate_step (timed through mlx_dspark's `reference_generate`); mlx-lm imports transformers
    (and its submodules) only for type hints and the HF loading we never call, so stub it if absent."""
    try:
        from mlx_lm.generate import generate_step
    except ImportError as exc:
        if "transformers" not in str(exc):
            raise
        for name in [m for m in sys.modules if m == "transformers" or m.startswith("transformers.")]:
            del sys.modules[name]  # a half-imported attempt
        for name in [m for m in sys.modules if m == "mlx_lm" or m.startswith("mlx_lm.")]:
            del sys.modules[name]  # modules that failed midway import again against the stub
        sys.meta_path.insert(0, _TransformersStub())
        from mlx_lm.generate import generate_step
    return generate_step


def load_model(model_dir: Path) -> Any:
    """Build the mlx-lm model from config.json and load its weights exactly (quantized layers stay quantized)."""
    import importlib

    import mlx.core as mx
    from mlx import nn

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(cfg))
    files = sorted(glob.glob(str(model_dir / "model*.safetensors"))) or [str(model_dir / "target.safetensors")]
    weights: dict[str, Any] = {}
    for f in files:
        weights.update(mx.load(f))
    quant = cfg.get("quantization") or cfg.get("quantized_modules")
    if quant:
        default = {k: quant[k] for k in ("group_size", "bits") if k in quant}

        def predicate(path: str, module: Any) -> Any:
            if f"{path}.scales" not in weights:
                return False
            own = quant.get(path)
            return own if isinstance(own, dict) else (default or True)

        nn.quantize(model, class_predicate=predicate)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    # mlx-dspark's loader keeps quantization scales/biases in float32 (an export may hold float16).
    weights = {k: v.astype(mx.float32) if k.endswith((".scales", ".biases")) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    """n well-mixed token ids (an LCG over the vocabulary, away from the low special ids)."""
    state = 0x9E3779B9 + seed
    out = []
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        out.append(256 + (state >> 33) % (vocab - 256))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--prefill", default="1024,4096,8000", help="prompt lengths for prefill (comma-separated)")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--decode-prompt", type=int, default=128, help="prompt length before decoding")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill-chunk", type=int, default=None, help="our prefill chunk (default: the adapter's)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)

    import mlx.core as mx

    from mlx_dspark.adapters.mlx.mlx_lm_reference import reference_generate
    from mlx_dspark.adapters.mlx.target import MlxTargetModel
    from mlx_dspark.application.engine import decode
    from mlx_dspark.domain.events import Finished, TokensCommitted
    from mlx_dspark.domain.tokens import SamplingParams, StopRule

    _import_mlx_lm_generate()  # installs the transformers stub where it is missing
    model = load_model(args.model)
    vocab = int(model.args.vocab_size)
    kwargs = {} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}
    target = MlxTargetModel(model, **kwargs)
    greedy = SamplingParams()
    env = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "model": str(args.model),
    }
    with contextlib.suppress(Exception):  # informational only: not every MLX build has device_info
        env["device_info"] = {k: str(v) for k, v in mx.device_info().items()}
    print(json.dumps(env), flush=True)

    def ours_prefill(ids: list[int]) -> float:
        target.reset(0)
        t0 = time.perf_counter()
        target.prefill(ids, greedy, 0.5)
        return time.perf_counter() - t0

    def theirs_prefill(ids: list[int]) -> float:
        return reference_generate(model, ids, max_tokens=1).prefill_s

    def ours_decode(ids: list[int], n: int) -> tuple[float, list[int]]:
        target.reset(0)
        out: list[int] = []
        first = end = 0.0
        for ev in decode(target, ids, greedy, StopRule(max_tokens=n, eos_ids=frozenset()), _Clock()):
            if isinstance(ev, TokensCommitted):
                if not out:
                    first = time.perf_counter()
                out.extend(ev.tokens)
            elif isinstance(ev, Finished):
                end = time.perf_counter()
        return (len(out) - 1) / (end - first), out

    def theirs_decode(ids: list[int], n: int) -> tuple[float, list[int]]:
        run = reference_generate(model, ids, max_tokens=n)
        return run.tokens_per_second, list(run.token_ids)

    results: dict[str, Any] = {"environment": env, "prefill": {}, "decode": {}}
    # Warm up both paths (kernel compilation, allocator).
    warm = prompt_ids(300, vocab, 99)
    for _ in range(2):
        ours_prefill(warm)
        theirs_prefill(warm)
        ours_decode(warm[:32], 16)
        theirs_decode(warm[:32], 16)

    for length in [int(x) for x in args.prefill.split(",") if x.strip()]:
        ids = prompt_ids(length, vocab, length)
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(ours_prefill(ids))
            theirs.append(theirs_prefill(ids))
        ratios = [t / o for o, t in zip(ours, theirs)]
        row = {
            "ours_tok_s": length / statistics.median(ours),
            "mlx_lm_tok_s": length / statistics.median(theirs),
            "ratio_median": statistics.median(ratios),
            "ours_s": ours,
            "mlx_lm_s": theirs,
        }
        results["prefill"][length] = row
        print(
            f"prefill {length:>6} tokens: ours {row['ours_tok_s']:9.0f} tok/s  mlx-lm {row['mlx_lm_tok_s']:9.0f} tok/s"
            f"  ours/mlx-lm {row['ratio_median']:.3f}",
            flush=True,
        )

    ids = prompt_ids(args.decode_prompt, vocab, 7)
    ours_r, theirs_r, same = [], [], True
    for _ in range(args.repeats):
        a, ta = ours_decode(ids, args.decode_tokens)
        b, tb = theirs_decode(ids, args.decode_tokens)
        ours_r.append(a)
        theirs_r.append(b)
        same = same and ta == tb
    row = {
        "ours_tok_s": statistics.median(ours_r),
        "mlx_lm_tok_s": statistics.median(theirs_r),
        "ratio_median": statistics.median([a / b for a, b in zip(ours_r, theirs_r)]),
        "identical_tokens": same,
        "ours_runs": ours_r,
        "mlx_lm_runs": theirs_r,
        "tokens": args.decode_tokens,
        "prompt": args.decode_prompt,
    }
    results["decode"] = row
    print(
        f"decode {args.decode_tokens} tokens after {args.decode_prompt}: ours {row['ours_tok_s']:.1f} tok/s  "
        f"mlx-lm {row['mlx_lm_tok_s']:.1f} tok/s  ours/mlx-lm {row['ratio_median']:.3f}  identical={same}",
        flush=True,
    )
    out = args.json or (Path(os.environ["OUT"]) / "gpu_bench.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.write_text(json.dumps(results, indent=1))
    return 0


class _Clock:
    def now(self) -> float:
        return time.perf_counter()


if __name__ == "__main__":
    raise SystemExit(main())
