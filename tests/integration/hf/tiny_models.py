"""Tiny random llama / qwen2 / gemma3 models written as GGUF files (the llama.cpp way) and as mlx-lm directories.

The GGUF writer applies llama.cpp's conventions (Q/K row permutation, Gemma `1 + w` norms, quantized
blocks), so loading the file back and matching the reference logits checks the converter's fix-ups.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("h e", "l l", "o Ġ", "w o", "r l", "he ll", "Ġ w", "hell o")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HIDDEN, LAYERS, FFN, HEADS, KV_HEADS, HEAD_DIM = 64, 2, 128, 4, 2, 16


def vocabulary() -> list[str]:
    """A byte-level BPE vocabulary: the 256 byte symbols, the merge results, then the special tokens."""
    tokens = list(bytes_to_unicode().values())
    tokens += ["".join(m.split(" ")) for m in MERGES]
    return tokens + list(SPECIALS)


def hf_tokenizer() -> PreTrainedTokenizerFast:
    """The same vocabulary as an HF fast tokenizer (for mlx-lm directories)."""
    vocab = {t: i for i, t in enumerate(vocabulary())}
    merges = [tuple(m.split(" ")) for m in MERGES]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<|im_start|>", chat_template=CHATML
    )
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    return tok


def model_args(arch: str) -> dict[str, Any]:
    """mlx-lm config for a tiny model of the GGUF architecture `arch`."""
    common = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 6 if arch == "gemma3" else LAYERS,  # gemma3_text needs a full 5:1 local/global cycle
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-6,
        "vocab_size": len(vocabulary()),
        "max_position_embeddings": 2048,
    }
    if arch == "llama":
        return {
            **common,
            "model_type": "llama",
            "head_dim": HEAD_DIM,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        }
    if arch == "qwen2":
        return {**common, "model_type": "qwen2", "rope_theta": 1000000.0, "tie_word_embeddings": False}
    return {
        **common,
        "model_type": "gemma3_text",
        "head_dim": HEAD_DIM,
        "query_pre_attn_scalar": HEAD_DIM,
        "sliding_window": 4,
        "rope_theta": 1000000.0,
    }


def build_reference(arch: str, seed: int = 0) -> tuple[Any, dict[str, np.ndarray]]:
    """A random mlx-lm model of `arch` and its weights (norms randomized too, so norm fix-ups matter)."""
    from mlx_lm.utils import _get_classes

    cfg = model_args(arch)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    rng = np.random.default_rng(seed)
    weights = {k: np.array(v, dtype=np.float32) for k, v in tree_flatten(model.parameters())}
    for name in list(weights):
        if name.endswith("norm.weight"):
            base = 0.0 if arch == "gemma3" else 1.0
            weights[name] = (base + 0.2 * rng.standard_normal(weights[name].shape)).astype(np.float32)
        elif name.endswith(".bias"):
            weights[name] = (0.1 * rng.standard_normal(weights[name].shape)).astype(np.float32)
    if arch == "gemma3":
        weights.pop("lm_head.weight", None)  # Gemma ties the head to the embedding
    return model, weights


def load_reference(model: Any, weights: dict[str, np.ndarray]) -> Any:
    """Put `weights` into `model` (after its own sanitize) and return it."""
    model.load_weights(list(model.sanitize({k: mx.array(v) for k, v in weights.items()}).items()), strict=True)
    mx.eval(model.parameters())
    return model


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}


def gguf_name(name: str, arch: str) -> str:
    """The llama.cpp tensor name of an mlx-lm parameter."""
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    module, _, kind = name.rpartition(".")
    if module in top:
        return f"{top[module]}.{kind}"
    _, _, layer, role = module.split(".", 3)
    if arch == "gemma3":
        norms = {
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
        }
    else:
        norms = {"post_attention_layernorm": "ffn_norm"}
    return f"blk.{layer}.{_GGUF_NAMES.get(role) or norms[role]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's convert script interleaves each head's rows for its RoPE layout
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantized_choice(name: str) -> gguf.GGMLQuantizationType:
    """The GGUF type each tensor is stored as: a mix of F32, Q8_0 and Q4_0."""
    q = gguf.GGMLQuantizationType
    if name.endswith(("norm.weight", ".bias")):
        return q.F32
    if "self_attn" in name or name.startswith("lm_head"):
        return q.Q4_0
    return q.Q8_0


def write_gguf(arch: str, weights: dict[str, np.ndarray], path: Path, *, quantize: bool) -> dict[str, np.ndarray]:
    """Write `weights` as a llama.cpp-style GGUF and return the weights as the file really holds them.

    Quantized tensors lose precision, so the returned weights (in mlx-lm layout) are the dequantized
    ones: a reference model built from them must match the converted model to float error.
    """
    cfg = model_args(arch)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    if arch == "llama":
        writer.add_rope_dimension_count(HEAD_DIM)
    if arch == "gemma3":
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_sliding_window(cfg["sliding_window"])
    tokens = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    held: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        qtype = quantized_choice(name) if quantize else gguf.GGMLQuantizationType.F32
        stored = w
        if qtype != gguf.GGMLQuantizationType.F32:
            stored = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)
        held[name] = stored.astype(np.float32)
        on_disk = stored
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            on_disk = _permute(w, HEADS if "q_proj" in name else KV_HEADS)
        if arch == "gemma3" and name.endswith("norm.weight"):
            on_disk = w + 1.0
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name, arch), np.ascontiguousarray(on_disk, dtype=np.float32))
        else:
            writer.add_tensor(
                gguf_name(name, arch), gguf.quants.quantize(np.ascontiguousarray(on_disk), qtype), raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def write_mlx_dir(arch: str, weights: dict[str, np.ndarray], path: Path, **config_extra: Any) -> Path:
    """An mlx-lm checkpoint directory (config.json, model.safetensors, tokenizer files)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = model_args(arch) | config_extra
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    hf_tokenizer().save_pretrained(str(path))
    return path


def logits(model: Any, ids: list[int]) -> np.ndarray:
    """The model's float32 logits for one sequence."""
    out = model(mx.array([ids]))
    mx.eval(out)
    return np.array(out.astype(mx.float32))[0]
