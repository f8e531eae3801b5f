"""Reading drafter checkpoints (config.json + safetensors), strict name/shape checks, target-fit checks,
and on-load precision: dtype and quantization, chosen by what the device can do.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from mlx_dspark.adapters.mlx import model_parts
from mlx_dspark.adapters.mlx.drafters.config import BackboneConfig
from mlx_dspark.domain.errors import IncompatibleDrafter, ModelUnavailable

QUANT_GROUP = 64
# Written by training/conversion tools and reconstructed from the target, never used here.
IGNORED_TENSORS = frozenset({"verifier_norm.weight", "verifier_lm_head.weight", "t2d"})


def resolve_path(spec: str) -> Path:
    """A local checkpoint dir for `spec`: a directory, or an HF repo id resolved by the hf adapter.

    Raises:
        ModelUnavailable: nothing found.
    """
    p = Path(spec).expanduser()
    if p.is_dir():
        return p
    try:
        from mlx_dspark.adapters.hf.resolve import resolve_snapshot
    except ImportError as exc:
        raise ModelUnavailable(message=f"drafter {spec!r} is not a local directory") from exc
    return Path(resolve_snapshot(spec))


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """`config.json` and every tensor of the `*.safetensors` shards (plus a `d2t.npy` table if shipped).

    Raises:
        ModelUnavailable: no config or no weights.
    """
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelUnavailable(message=f"{path}: no config.json")
    raw = json.loads(cfg_file.read_text())
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelUnavailable(message=f"{path}: no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for shard in shards:
        loaded = mx.load(str(shard))
        assert isinstance(loaded, dict)
        weights.update(loaded)
    d2t_file = path / "d2t.npy"
    if "d2t" not in weights and d2t_file.is_file():
        import numpy as np

        weights["d2t"] = mx.array(np.load(d2t_file))
    return raw, weights


def check_names(
    expected: Iterable[str], present: Iterable[str], *, optional: Iterable[str] = (), where: str = "drafter"
) -> None:
    """Strict tensor-name check.

    Raises:
        ModelUnavailable: naming every missing and every unexpected tensor.
    """
    want, have, opt = set(expected), set(present) - IGNORED_TENSORS, set(optional)
    missing = sorted(want - have)
    unexpected = sorted(have - want - opt)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {', '.join(unexpected)}")
        raise ModelUnavailable(message=f"{where}: checkpoint does not match its config ({'; '.join(parts)})")


def load_strict(module: nn.Module, weights: Mapping[str, mx.array], *, where: str = "drafter") -> None:
    """Load `weights` into `module` after checking names and shapes against the module's parameters.

    Raises:
        ModelUnavailable: a missing/unexpected tensor or a shape mismatch (named).
    """
    params = dict(tree_flatten(module.parameters()))
    check_names(params, weights, where=where)
    wrong = [
        f"{name} {tuple(weights[name].shape)} (expected {tuple(p.shape)})"
        for name, p in params.items()
        if tuple(weights[name].shape) != tuple(p.shape)
    ]
    if wrong:
        raise ModelUnavailable(message=f"{where}: tensor shapes do not match the config: {'; '.join(wrong)}")
    module.load_weights([(name, weights[name]) for name in params], strict=True)


def check_fits_target(cfg: BackboneConfig, target_model: nn.Module, *, uses_target_vocab: bool, where: str) -> None:
    """Refuse a drafter whose width, vocabulary or target-layer selection does not fit the target.

    Raises:
        IncompatibleDrafter: with the mismatching numbers.
    """
    t_hidden = model_parts.hidden_size(target_model)
    t_layers = model_parts.num_layers(target_model)
    t_vocab = model_parts.vocab_size(target_model)
    problems = []
    if cfg.target_hidden_size != t_hidden:
        problems.append(f"it reads target features of width {cfg.target_hidden_size}, the target's is {t_hidden}")
    if uses_target_vocab and cfg.hidden_size != t_hidden:
        problems.append(f"its width {cfg.hidden_size} differs from the target's {t_hidden} (shared embedding/head)")
    if cfg.num_target_layers is not None and cfg.num_target_layers != t_layers:
        problems.append(f"it was trained on a {cfg.num_target_layers}-layer target, this one has {t_layers} layers")
    bad = [i for i in cfg.target_layer_ids if not -1 <= i < t_layers]
    if bad:
        problems.append(f"target layers {bad} do not exist in a {t_layers}-layer target")
    if cfg.vocab_size is not None and cfg.vocab_size != t_vocab:
        problems.append(f"its vocabulary has {cfg.vocab_size} tokens, the target's {t_vocab}")
    if not 0 <= cfg.mask_token_id < t_vocab:
        problems.append(f"mask token {cfg.mask_token_id} is outside the target vocabulary of {t_vocab}")
    if problems:
        raise IncompatibleDrafter(message=f"{where} does not fit this target: {'; '.join(problems)}")


def device_is_gpu() -> bool:
    """Capability check: is the default device an accelerator (Metal or CUDA)?"""
    return mx.default_device().type == mx.DeviceType.gpu


def default_bits() -> int:
    """4-bit on accelerators (drafting is bandwidth-bound there); none on CPU, where fp32 matmuls are faster
    than quantized ones (measured in tests/integration/drafters, see the report in test_quantization)."""
    return 4 if device_is_gpu() else 0


def default_dtype(checkpoint_dtype: mx.Dtype) -> mx.Dtype:
    """float32 on CPU (no fast bf16 there); the checkpoint's bf16/fp32 on accelerators, never fp16 (NaNs, §2.6)."""
    if not device_is_gpu():
        return mx.float32
    return mx.bfloat16 if checkpoint_dtype == mx.float16 else checkpoint_dtype


def _quantizable(path: str, module: nn.Module) -> bool:
    if not isinstance(module, (nn.Linear, nn.Embedding)) or path.startswith("confidence_head"):
        return False
    w = module.weight
    return w.ndim == 2 and w.shape[-1] % QUANT_GROUP == 0 and w.shape[0] >= 8


def prepare(module: nn.Module, *, bits: int | None, dtype: mx.Dtype | None) -> None:
    """Cast floating parameters to `dtype` (default by device) and quantize to `bits` (None = by device).

    Raises:
        ValueError: bits other than 0, 4 or 8.
    """
    if bits is None:
        bits = default_bits()
    if bits not in (0, 4, 8):
        raise ValueError(f"drafter bits must be 0, 4 or 8, got {bits}")
    first = next((p for _, p in tree_flatten(module.parameters())), None)
    target_dtype = dtype or default_dtype(first.dtype if first is not None else mx.float32)
    module.set_dtype(target_dtype)
    if bits:
        nn.quantize(module, group_size=QUANT_GROUP, bits=bits, class_predicate=_quantizable)
    mx.eval(module.parameters())
