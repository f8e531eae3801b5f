"""GGUF → mlx-lm conversion (llama, qwen2, gemma3) and the torch-free tokenizer built from GGUF metadata.

The result is an ordinary mlx-lm directory (config.json, model.safetensors, tokenizer files) kept in the
cache under the GGUF's content hash, so `mlx_lm.load` reads it on every later start.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mlx_dspark.adapters.hf.cache import atomic_dir, memo_sha256
from mlx_dspark.adapters.hf.tokenizer import END_OF_TURN_TOKENS
from mlx_dspark.domain.errors import ModelUnavailable

# Bump when the written layout or the conversion changes: old entries are then simply not found.
CONVERTER_VERSION = 1

# GGUF architecture -> mlx-lm model_type
ARCHITECTURES: dict[str, str] = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}

_SUFFIXES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_NORMS = {
    "llama": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "qwen2": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _fail(path: Path, why: str) -> ModelUnavailable:
    return ModelUnavailable(message=f"GGUF file {path}: {why}")


def open_gguf(path: Path) -> Any:
    """Open a GGUF file with `gguf.GGUFReader`, checking that every tensor lies inside the file.

    Raises:
        ModelUnavailable: missing, unreadable, not a GGUF, or truncated.
    """
    import gguf

    if not path.is_file():
        raise _fail(path, "no such file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/IndexError/... on bad headers and short files
        raise _fail(path, f"not a readable GGUF (corrupt or truncated?): {type(exc).__name__}: {exc}") from exc
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise _fail(path, f"truncated: tensor {t.name} ends at byte {end} but the file has {size}")
    return reader


def tensor_shapes(reader: Any) -> dict[str, tuple[int, ...]]:
    """numpy-order shapes of a GGUF's tensors by GGUF name."""
    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}


def metadata(reader: Any) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def gguf_architecture(reader: Any, path: Path) -> str:
    """The file's `general.architecture`, checked against the supported ones.

    Raises:
        ModelUnavailable: the architecture is not supported.
    """
    arch = reader.fields.get("general.architecture")
    name = arch.contents() if arch is not None else None
    if name not in ARCHITECTURES:
        raise _fail(path, f"architecture {name!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    return str(name)


def model_config(
    meta: Mapping[str, Any], arch: str, shapes: Mapping[str, tuple[int, ...]], path: Path
) -> dict[str, Any]:
    """The mlx-lm config.json for this GGUF (model args from `{arch}.*` metadata).

    Args:
        meta: the GGUF metadata.
        arch: the GGUF architecture.
        shapes: numpy shapes of the GGUF tensors by GGUF name (`token_embd.weight` gives the vocabulary).
        path: the file, for error messages.

    Raises:
        ModelUnavailable: required metadata is missing or the file uses unsupported RoPE scaling.
    """

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise _fail(path, f"metadata {arch}.{key} is missing")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in shapes or scaling not in (None, "none", "linear"):
        raise _fail(path, f"RoPE scaling {scaling or 'rope_freqs'!r} is not supported by this converter")
    cfg: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(shapes["token_embd.weight"][0]),
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
    }
    if scaling == "linear":
        cfg["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    if arch == "gemma3":
        head_dim = int(get("attention.key_length", 256))
        cfg |= {
            "head_dim": head_dim,
            "query_pre_attn_scalar": head_dim,
            "sliding_window": int(get("attention.sliding_window", 512)),
            "rope_local_base_freq": float(get("rope.freq_base_swa", 10000.0)),
        }
        pattern = meta.get("gemma3.attention.sliding_window_pattern")
        if isinstance(pattern, int) and pattern > 0:  # absent in most files: mlx-lm's default (6) is Gemma 3's
            cfg["sliding_window_pattern"] = pattern
    else:
        cfg["tie_word_embeddings"] = "output.weight" not in shapes
    if arch == "llama":
        cfg["head_dim"] = int(
            meta.get("llama.attention.key_length") or meta.get("llama.rope.dimension_count") or hidden // heads
        )
    return cfg


def mlx_name(gguf_name: str, arch: str) -> str | None:
    """The mlx-lm parameter name of a GGUF tensor, or None when it has no counterpart."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk":
        return None
    layer, role = parts[1], parts[2]
    target = _SUFFIXES.get(role) or _NORMS[arch].get(role)
    return None if target is None else f"model.layers.{layer}.{target}.{kind}"


def _unpermute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K (it permutes rows for its RoPE layout)."""
    rows = a.shape[0]
    return a.reshape(n_head, rows // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _pack_exact(raw: np.ndarray, qtype: Any) -> tuple[dict[str, np.ndarray], int] | None:
    """Re-pack Q4_0 / Q4_1 / Q8_0 blocks into MLX affine group-32 form exactly, or None for other types.

    Returns:
        ({"weight", "scales", "biases"}, bits).
    """
    import gguf

    q = gguf.GGMLQuantizationType
    rows = raw.shape[0]
    if qtype in (q.Q4_0, q.Q4_1):
        size = 18 if qtype == q.Q4_0 else 20
        blocks = raw.reshape(rows, -1, size)
        d = _f16_field(blocks, 0)
        bias = -8.0 * d if qtype == q.Q4_0 else _f16_field(blocks, 2)
        qs = blocks[..., size - 16 :]
        elems = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # GGUF: low nibbles are elements 0..15
        packed = (elems[..., 0::2] | (elems[..., 1::2] << 4)).astype(np.uint8)  # MLX: element i in nibble i
        return {"weight": packed.reshape(rows, -1).view(np.uint32), "scales": d, "biases": bias}, 4
    if qtype == q.Q8_0:
        blocks = raw.reshape(rows, -1, 34)
        d = _f16_field(blocks, 0)
        levels = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return {"weight": levels.reshape(rows, -1).view(np.uint32), "scales": d, "biases": -128.0 * d}, 8
    return None


def convert_weights(
    reader: Any, arch: str, cfg: Mapping[str, Any], path: Path, *, keep_quantized: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """All tensors under mlx-lm names, fixed up for mlx-lm's conventions.

    Args:
        reader: an open `GGUFReader`.
        arch: the GGUF architecture.
        cfg: the model config (head counts for the llama un-permute).
        path: the file, for error messages.
        keep_quantized: keep Q4_0/Q4_1/Q8_0 matrices as exact MLX quantized tensors (smaller, but slower on
            CPUs where MLX's quantized matmul is not BLAS-backed); everything else is dequantized to float32.

    Returns:
        (weights, per-layer quantization entries for config.json).

    Raises:
        ModelUnavailable: a tensor has no mlx-lm counterpart.
    """
    import gguf

    weights: dict[str, np.ndarray] = {}
    quant: dict[str, Any] = {}
    unknown = [t.name for t in reader.tensors if mlx_name(t.name, arch) is None]
    if unknown:
        raise _fail(path, f"tensors with no {ARCHITECTURES[arch]} counterpart: {', '.join(unknown[:8])}")
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    for t in reader.tensors:
        name = mlx_name(t.name, arch)
        assert name is not None
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest first; numpy the other way
        module, _, kind = name.rpartition(".")
        packed = None
        if keep_quantized and kind == "weight" and len(shape) == 2 and t.tensor_type not in plain:
            packed = _pack_exact(np.asarray(t.data), t.tensor_type)
        if packed is not None:
            parts, bits = packed
            quant[module] = {"group_size": 32, "bits": bits}
        else:
            parts = {kind: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)}
        if arch == "llama" and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            n_head = cfg["num_attention_heads"] if module.endswith("q_proj") else cfg["num_key_value_heads"]
            # Rows are permuted whole, so packed weights, scales and biases move together.
            parts = {k: _unpermute_rows(v, n_head) for k, v in parts.items()}
        if arch == "gemma3" and module.endswith("norm") and kind == "weight":
            parts = {k: v - 1.0 for k, v in parts.items()}  # llama.cpp stores 1 + w; mlx-lm adds the 1 itself
        for k, v in parts.items():
            weights[f"{module}.{k}"] = np.ascontiguousarray(v)
    return weights, quant


def _token_ids(meta: Mapping[str, Any], *keys: str) -> list[int]:
    out: list[int] = []
    for key in keys:
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and value >= 0 and value not in out:
            out.append(value)
    return out


def build_tokenizer(meta: Mapping[str, Any], arch: str, path: Path) -> Any:
    """A `PreTrainedTokenizerFast` from GGUF metadata, without torch.

    transformers' GGUF tokenizer reader imports torch, so the dict its converter wants is built here
    from `tokenizer.*` metadata and handed to the (tokenizers-only) converter module.

    Raises:
        ModelUnavailable: the file has no tokenizer or one the converter does not know.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    if "tokenizer.ggml.tokens" not in meta:
        raise _fail(path, "it carries no tokenizer (tokenizer.ggml.tokens is missing)")
    groups = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok, tok_cfg = groups["tokenizer"], groups["tokenizer_config"]
    if tok.get("tokenizer_type") == "llama":
        tok_cfg.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    try:
        backend, _ = convert_gguf_tokenizer(arch, tok)
    except Exception as exc:
        raise _fail(path, f"cannot build its tokenizer: {type(exc).__name__}: {exc}") from exc
    tokens = tok["tokens"]
    special = {
        name: tokens[meta[f"tokenizer.ggml.{key}"]]
        for name, key in _SPECIAL_TOKENS.items()
        if isinstance(meta.get(f"tokenizer.ggml.{key}"), int) and 0 <= meta[f"tokenizer.ggml.{key}"] < len(tokens)
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=tok_cfg.get("chat_template"),
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
        add_eos_token=bool(tok_cfg.get("add_eos_token", False)),
        **special,
    )


def eos_token_ids(meta: Mapping[str, Any], tokenizer: Any) -> list[int]:
    """Every id that ends generation: eos, end-of-turn/message ids and known end-of-turn tokens."""
    ids = _token_ids(meta, "eos_token_id", "eot_token_id", "eom_token_id")
    vocab = tokenizer.get_added_vocab()
    ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and vocab[t] not in ids]
    return ids


def write_mlx_dir(gguf_path: Path, out: Path, *, keep_quantized: bool = False, source: str | None = None) -> None:
    """Convert `gguf_path` into an mlx-lm directory `out` (config.json, model.safetensors, tokenizer files).

    Args:
        gguf_path: the GGUF file.
        out: an existing, empty directory.
        keep_quantized: see `convert_weights`.
        source: a note recorded in config.json (the content hash).

    Raises:
        ModelUnavailable: corrupt file, unsupported architecture or tokenizer.
    """
    import mlx.core as mx

    reader = open_gguf(gguf_path)
    arch = gguf_architecture(reader, gguf_path)
    meta = metadata(reader)
    shapes = tensor_shapes(reader)
    if "token_embd.weight" not in shapes:
        raise _fail(gguf_path, "it has no token_embd.weight tensor")
    cfg = model_config(meta, arch, shapes, gguf_path)
    weights, quant = convert_weights(reader, arch, cfg, gguf_path, keep_quantized=keep_quantized)
    tokenizer = build_tokenizer(meta, arch, gguf_path)
    cfg["eos_token_id"] = eos_token_ids(meta, tokenizer)
    bos = _token_ids(meta, "bos_token_id")
    if bos:
        cfg["bos_token_id"] = bos[0]
    if quant:
        cfg["quantization"] = {"group_size": 32, "bits": 8, **quant}
    cfg["mlx_dspark"] = {"converter_version": CONVERTER_VERSION, "source": source or str(gguf_path)}
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}, {"format": "mlx"})
    del weights
    tokenizer.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


def converted_dir(
    gguf_path: Path,
    cache_dir: Path,
    *,
    keep_quantized: bool = False,
    sha256: str | None = None,
    on_convert: Callable[[Path], None] | None = None,
) -> Path:
    """The cached mlx-lm directory for a GGUF file, converting it once (atomically) if absent.

    Layout: `<cache_dir>/gguf/v<CONVERTER_VERSION>-<sha256>-<f32|quantized>/`.

    Args:
        gguf_path: the GGUF file.
        cache_dir: the mlx-dspark cache root.
        keep_quantized: see `convert_weights`.
        sha256: the file's content hash when already known (verified), else computed (and remembered).
        on_convert: called with the entry path before a conversion starts (progress reporting).

    Returns:
        The entry directory, loadable by `mlx_lm.load`.
    """
    digest = sha256 or memo_sha256(gguf_path, cache_dir)
    entry = cache_dir / "gguf" / f"v{CONVERTER_VERSION}-{digest}-{'quantized' if keep_quantized else 'f32'}"
    if (entry / "config.json").is_file():
        return entry
    if on_convert is not None:
        on_convert(entry)
    with atomic_dir(entry) as tmp:
        write_mlx_dir(gguf_path, tmp, keep_quantized=keep_quantized, source=f"sha256:{digest}")
    return entry
