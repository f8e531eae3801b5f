"""One GPU slot of drafter distillation for a target (the default model, or one exported from its GGUF with
`--name`, e.g. Qwen2.5-Coder-1.5B): data, training, profile, curve, decode bench.

Runs on a bare CUDA host with MLX (no registry, no Hugging Face download): the target comes as an exact
export of the GGUF's quantized blocks (`export_target`, run on the CPU side), the tokenizer as its
`tokenizer.json` and chat template. `scripts/gpu_slot.sh` drives it call by call (`scripts/slot_plan.md`).
Phases (each writes under --work; `all` runs diag, data, train, bench):

  diag     exactness of the lock-step generator on this device, bf16 vs f32 greedy agreement, generation
           throughput at B = 256 / 512 / 1024.
  data     self-instruct prompts written by the target, then responses (greedy and sampled) to the mixed
           prompt set (`application/lab/prompt_mix.py`), then multi-turn follow-ups; held-out prompts never enter.
  train    the variants side by side in parallel processes (equal wall time), each through the training use
           case (`application/lab/training.py` over `MlxDrafterTrainer`), resumed from what an earlier call left;
           every run stops at --deadline with a checkpoint; then `curve`.
  profile  each variant alone for a few dozen steps per compute dtype: block tokens/s, steps/s, and the
           split between the target-side forward and the drafter step.
  curve    curve.json: per variant, held-out τ against block tokens and training seconds.
  pack-data / unpack-data  this slot's data as uint16 pieces for the way back, and back into train/heldout.npz.
  merge-data               add earlier slots' training sequences (--data-file a.npz,b.npz) to this slot's.
  bench    plain vs DSpark vs DFlash greedy decode tok/s on the held-out prompts (the project's decode loop).

Usage: python gpu_distill.py PHASE --model DIR --work DIR [...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

T0 = time.monotonic()


def log(work: Path, *parts: Any) -> None:
    line = f"[{time.monotonic() - T0:7.1f}s] " + " ".join(str(p) for p in parts)
    print(line, flush=True)
    with open(work / "log.txt", "a") as f:
        f.write(line + "\n")


# target and tokenizer ---------------------------------------------------------------------------------------


# GGUF block types the export keeps as they are (exact MLX affine blocks or plain floats); any other (K-quants)
# sends the GGUF file itself, converted on the device (`_gguf_weights`).
_EXPORT_EXACT = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
DEFAULT_TARGET = {"name": "default", "identity": "smollm2-135m-q4_1", "tokenizer_size": 49152, "mask_token_id": 16}


def export_target(gguf_path: str, out: str, name: str | None = None) -> None:
    """CPU side: the target in the smallest faithful form, config, tokenizer.json and chat template.

    A GGUF of Q4_0/Q4_1/Q8_0/float tensors becomes exact MLX affine blocks (uint32 + float16 scales/biases,
    ~ the GGUF's size: `target.safetensors`); one with K-quant blocks (Q4_K_M: Qwen2.5-Coder-1.5B) travels as the
    GGUF itself (`target.gguf`), which `load_target` converts on the device with this project's converter (MLX's
    own GGUF reader decodes Q4_K wrongly). `config.json` also names the target for training (`slot_target`)."""
    import shutil
    import types

    import mlx.core as mx

    from mlx_dspark.adapters.hf import gguf
    from mlx_dspark.adapters.hf.tokenizer import HfTokenizer

    path = Path(gguf_path)
    reader = gguf.open_gguf(path)
    arch = gguf.gguf_architecture(reader, path)
    meta = gguf.metadata(reader)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    cfg = gguf.model_config(meta, arch, shapes, path)
    tok = gguf.build_tokenizer(meta, arch, path)
    cfg["eos_token_id"] = gguf.eos_token_ids(meta, tok)
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    if all(t.tensor_type.name in _EXPORT_EXACT for t in reader.tensors):
        weights, quant = gguf.convert_weights(reader, arch, cfg, path, keep_quantized=True)
        cfg["quantized_modules"] = quant
        arrays = {}
        for k, v in weights.items():
            a = mx.array(v)
            if k.endswith((".scales", ".biases")):
                a = a.astype(mx.float16)  # exact: GGUF stores them as float16
            arrays[k] = a
        mx.save_safetensors(str(o / "target.safetensors"), arrays)
    else:
        shutil.copyfile(path, o / "target.gguf")
    if name and name != "default":
        ht = HfTokenizer(types.SimpleNamespace(_tokenizer=tok), cfg["eos_token_id"])  # as mlx-lm's wrapper holds it
        cfg["slot_target"] = {
            "name": name,
            "identity": path.stem,  # the GGUF file it came from
            "tokenizer_size": ht.vocab_size,
            "special_ids": list(ht.special_ids),
            "reserved_ids": list(ht.reserved_ids),
        }
    (o / "config.json").write_text(json.dumps(cfg, indent=1))
    tok.backend_tokenizer.save(str(o / "tokenizer.json"))
    (o / "chat_template.jinja").write_text(tok.chat_template)


def slot_target(model_dir: Path) -> dict[str, Any]:
    """What training needs to know of the staged target: name, identity, tokenizer size, special and reserved ids,
    the mask token (0: the training use case's choice) and its layer count. Exports written before targets
    other than the default carry no `slot_target`: they are the default model."""
    cfg = json.loads((model_dir / "config.json").read_text())
    info = {"special_ids": [], "reserved_ids": [], "mask_token_id": 0, **(cfg.get("slot_target") or DEFAULT_TARGET)}
    info["num_layers"] = int(cfg.get("num_hidden_layers", 30))
    return info


def _gguf_weights(model_dir: Path, dtype: str) -> dict[str, Any]:
    """The staged GGUF's tensors under mlx-lm names in `dtype`, converted once by the project's converter (exact
    float32 dequantization, then the cast) and kept beside it as `target-<dtype>.safetensors` for later calls."""
    import mlx.core as mx

    cached = model_dir / f"target-{dtype}.safetensors"
    if not cached.is_file():
        import types

        try:
            import yaml  # noqa: F401 - the gguf package imports it at load; only its metadata helpers use it
        except ImportError:
            sys.modules["yaml"] = types.ModuleType("yaml")
        from mlx_dspark.adapters.hf import gguf

        path = model_dir / "target.gguf"
        reader = gguf.open_gguf(path)
        arch = gguf.gguf_architecture(reader, path)
        cfg = json.loads((model_dir / "config.json").read_text())
        weights, _ = gguf.convert_weights(reader, arch, cfg, path, keep_quantized=False)
        arrays = {}
        for k in list(weights):
            arrays[k] = mx.array(weights.pop(k)).astype(getattr(mx, dtype))  # frees each float32 copy as it goes
            mx.eval(arrays[k])
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp.safetensors")
        mx.save_safetensors(str(tmp), arrays)
        os.replace(tmp, cached)  # atomic: runs started side by side never read half a file
        return arrays
    loaded = mx.load(str(cached))
    assert isinstance(loaded, dict)
    return loaded


def load_target(model_dir: Path, dtype: str) -> Any:
    """The mlx-lm model of the export's family with every quantized block dequantized exactly, cast to `dtype`."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_unflatten

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("slot_target", None)
    # Either this script's export (`quantized_modules`, target.safetensors or target.gguf) or an mlx-lm checkpoint.
    quant = cfg.pop("quantized_modules", None)
    if quant is None:
        quant = {k: v for k, v in (cfg.pop("quantization", None) or {}).items() if isinstance(v, dict)}
    family = importlib.import_module(f"mlx_lm.models.{cfg.get('model_type', 'llama')}")
    model = family.Model(family.ModelArgs.from_dict(cfg))
    if (model_dir / "target.gguf").is_file():
        raw = _gguf_weights(model_dir, dtype)
    else:
        file = model_dir / "target.safetensors"
        raw = mx.load(str(file if file.is_file() else model_dir / "model.safetensors"))
    assert isinstance(raw, dict)
    want = getattr(mx, dtype)
    out = {}
    for module, q in quant.items():
        w = mx.dequantize(
            raw.pop(f"{module}.weight"),
            raw.pop(f"{module}.scales").astype(mx.float32),
            raw.pop(f"{module}.biases").astype(mx.float32),
            group_size=q["group_size"],
            bits=q["bits"],
        )
        out[f"{module}.weight"] = w.astype(want)
    out.update({k: v.astype(want) for k, v in raw.items()})
    model.update(tree_unflatten(list(out.items())))
    model.eval()
    mx.eval(model.parameters())
    return model


class Chat:
    """Chat rendering (the model's own Jinja template) and tokenization without transformers."""

    def __init__(self, model_dir: Path) -> None:
        import jinja2
        from tokenizers import Tokenizer

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string((model_dir / "chat_template.jinja").read_text())
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.eos = [int(t) for t in json.loads((model_dir / "config.json").read_text())["eos_token_id"]]

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.template.render(messages=messages, add_generation_prompt=True)
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode([t for t in ids if t not in self.eos]))


def heldout() -> list[dict[str, str]]:
    from mlx_dspark.application.lab.training import heldout_prompts

    return heldout_prompts()


# diag -------------------------------------------------------------------------------------------------------


def single_greedy(model: Any, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    out: list[int] = []
    for _ in range(n):
        t = int(mx.argmax(logits, axis=-1).item())
        out.append(t)
        if t in eos:
            break
        logits = model(mx.array([[t]]), cache=cache)[:, -1]
    return out


def old_left_padded(model: Any, prompts: list[list[int]], n: int, eos: set[int]) -> tuple[list[list[int]], bool]:
    """The earlier lock-step loop (left padding through mlx-lm's BatchKVCache), and whether its padded
    prefill left NaN in any cached key."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from mlx_dspark.adapters.mlx import model_parts

    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    x = mx.array([[0] * k + list(p) for k, p in zip(pad, prompts, strict=True)])
    cache = [BatchKVCache(pad) for _ in range(model_parts.num_layers(model))]
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    logits = model(x, cache=cache)[:, -1, :]
    nan = any(bool(mx.isnan(c.keys).any().item()) for c in cache if c.keys is not None)
    for _ in range(n):
        tok = mx.argmax(logits, axis=-1)
        logits = model(tok[:, None], cache=cache)[:, -1, :]
        for i, v in enumerate(tok.tolist()):
            if not done[i]:
                out[i].append(int(v))
                done[i] = int(v) in eos
    return out, nan


def diag(a: argparse.Namespace, work: Path) -> None:
    import mlx.core as mx

    from mlx_dspark.adapters.mlx.training.generate import generate_responses

    chat = Chat(Path(a.model))
    eos = set(chat.eos)
    held = heldout()
    n_diag, n_tok = (3, 6) if a.smoke else (16, 48)
    prompts = [chat.encode([{"role": "user", "content": p["prompt"]}]) for p in held[:n_diag]]
    report: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__}
    for dtype in () if not a.diag_exact else ("float32",) if a.smoke else ("bfloat16", "float32"):
        model = load_target(Path(a.model), dtype)
        ref = [single_greedy(model, p, n_tok, eos) for p in prompts]
        new = generate_responses(
            model,
            prompts,
            eos_ids=sorted(eos),
            max_new_tokens=n_tok,
            batch=8,
            temperatures=[0.0] * len(prompts),
            seed=0,
            refill_min=2,
        )
        old, nan = old_left_padded(model, prompts[:8], n_tok, eos)
        report[dtype] = {
            "lockstep_equal_single": sum(x == y for x, y in zip(new, ref, strict=True)),
            "old_leftpad_equal_single": sum(x == y for x, y in zip(old, ref[:8], strict=True)),
            "old_leftpad_nan_keys": nan,
            "of": len(prompts),
        }
        report[f"ref_{dtype}"] = ref
        log(work, "diag", dtype, report[dtype])
    agree = []
    f32 = report.get("ref_float32", [])
    for x, y in zip(report.get("ref_bfloat16", f32), f32, strict=True):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        agree.append(k)
    report["bf16_vs_f32_first_divergence"] = agree
    model = None
    log(work, "diag bf16 vs f32 greedy: tokens before the first difference", agree)
    model = load_target(Path(a.model), a.dtype)
    rng = random.Random(0)
    pool = [chat.encode([{"role": "user", "content": f"Tell me about topic number {i}."}]) for i in range(64)]
    for b in (4,) if a.smoke else [int(x) for x in a.diag_batches.split(",")]:
        ps = [pool[i % len(pool)] for i in range(b * 3)]
        temps = [0.0 if rng.random() < 0.5 else 0.7 for _ in ps]
        tops = [rng.choice(a.top_p_choices) for _ in ps]
        generate_responses(
            model, ps[:b], eos_ids=[], max_new_tokens=24, batch=b, temperatures=temps[:b], top_p=tops[:b], seed=1
        )  # warm the shapes
        t = time.perf_counter()
        out = generate_responses(
            model,
            ps,
            eos_ids=sorted(eos),
            max_new_tokens=8 if a.smoke else 96,
            batch=b,
            temperatures=temps,
            top_p=tops,
            seed=2,
        )
        dt = time.perf_counter() - t
        toks = sum(len(r or []) for r in out)
        report[f"tok_s_B{b}"] = toks / dt
        if toks / dt > report.get("best_tok_s", 0):
            report["best_tok_s"], report["best_batch"] = toks / dt, b
        log(
            work,
            f"diag throughput B={b}: {toks} tokens in {dt:.1f}s = {toks / dt:.0f} tok/s "
            f"(half sampled at T 0.7, top-p from {a.top_p_choices})",
        )
    (work / "diag.json").write_text(json.dumps(report))


# data -------------------------------------------------------------------------------------------------------


def _save_seqs(path: Path, seqs: list[tuple[list[int], int]], tags: list[str]) -> None:
    flat = np.concatenate([np.asarray(s, dtype=np.int32) for s, _ in seqs]) if seqs else np.zeros(0, np.int32)
    lens = np.array([len(s) for s, _ in seqs], dtype=np.int64)
    np.savez(path, ids=flat, lens=lens, prompt_lens=np.array([p for _, p in seqs], dtype=np.int64), tags=np.array(tags))


def load_seqs(path: Path) -> tuple[list[tuple[list[int], int]], list[str]]:
    z = np.load(path)
    ends = np.cumsum(z["lens"])
    starts = ends - z["lens"]
    ids = z["ids"]
    seqs = [(ids[s:e].tolist(), int(p)) for s, e, p in zip(starts, ends, z["prompt_lens"], strict=True)]
    return seqs, [str(t) for t in z["tags"]]


def _mixed(samples: int, seed: int, held_texts: list[str], queue: Any) -> None:
    from mlx_dspark.application.lab import prompt_mix
    from mlx_dspark.application.lab.training import builtin_conversations

    queue.put(prompt_mix.mixed_conversations(samples, seed, held_texts, builtin=builtin_conversations(40000, seed)))


def data(a: argparse.Namespace, work: Path) -> None:
    from mlx_dspark.adapters.mlx.training.generate import generate_responses
    from mlx_dspark.application.lab import prompt_mix

    chat = Chat(Path(a.model))
    held = heldout()
    held_texts = [p["prompt"] for p in held]  # all 30 stay out of the training prompts
    held_eval = held_texts[: a.heldout] if a.heldout else held_texts
    keep = prompt_mix.HeldoutFilter(held_texts)
    if (work / "diag.json").is_file() and not a.smoke:
        a.gen_batch = int(json.loads((work / "diag.json").read_text()).get("best_batch", a.gen_batch))
        log(work, f"data: batch {a.gen_batch} (fastest in diag)")
    # The mixed set is built on another core while the GPU writes the held-out and self-instruct data.
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    pending = ctx.SimpleQueue()
    pool = ctx.Process(target=_mixed, args=(a.samples, a.seed, held_texts, pending))
    pool.start()
    model = load_target(Path(a.model), a.dtype)
    rng = random.Random(a.seed)
    deadline = time.monotonic() + a.gen_seconds
    produced = [0]

    def gen(prompts: list[list[int]], temps: list[float], max_new: int, until: float | None) -> list[list[int] | None]:
        t = time.perf_counter()
        out = generate_responses(
            model,
            prompts,
            eos_ids=chat.eos,
            max_new_tokens=max_new,
            batch=a.gen_batch,
            temperatures=temps,
            top_p=[rng.choice(a.top_p_choices) for _ in prompts],
            seed=rng.randrange(1 << 30),
            deadline=until,
        )
        toks = sum(len(r or []) for r in out)
        produced[0] += toks
        log(
            work,
            f"generated {sum(r is not None for r in out)}/{len(prompts)} responses, {toks} tokens, "
            f"{toks / (time.perf_counter() - t):.0f} tok/s",
        )
        return out

    # Held-out greedy responses: evaluation only (teacher-forced τ), never training.
    held_ids = [chat.encode([{"role": "user", "content": t}]) for t in held_eval]
    held_out = gen(held_ids, [0.0] * len(held_ids), a.max_new, None)
    _save_seqs(
        work / "heldout.npz",
        [(p + r, len(p)) for p, r in zip(held_ids, held_out, strict=True) if r],
        ["heldout"] * len(held_ids),
    )

    # 1. Self-instruct: the target writes user requests.
    seeds = prompt_mix.self_instruct_seeds(rng, a.self_instruct)
    seed_out = gen([chat.encode(c) for c in seeds], [rng.choice([0.8, 0.9, 1.0]) for _ in seeds], 48, None)
    own: list[list[dict[str, str]]] = []
    seen: set[str] = set()
    for r in seed_out:
        text = chat.decode(r or []).strip().strip('"').strip()
        if 12 <= len(text) <= 400 and text not in seen and keep.clean(text):
            seen.add(text)
            own.append([{"role": "user", "content": text}])
    log(work, f"self-instruct: {len(own)} distinct prompts kept of {len(seeds)}")

    # 2. The mixed set: built-in templates, generated sources, the target's own prompts.
    mixed = pending.get()
    pool.join()
    convs = [(s, c) for s, c in mixed] + [("self", c) for c in own]
    rng.shuffle(convs)
    ids = [chat.encode(c) for _, c in convs]
    keepi = [i for i, p in enumerate(ids) if len(p) <= a.max_prompt]
    convs, ids = [convs[i] for i in keepi], [ids[i] for i in keepi]
    temps = [0.0 if rng.random() < a.greedy_share else rng.choice(a.temperatures) for _ in ids]
    follow_at = deadline - a.follow_seconds
    log(work, f"main set: {len(ids)} prompts; mean prompt {np.mean([len(p) for p in ids]):.0f} tokens")
    out = gen(ids, temps, a.max_new, follow_at)
    seqs, tags = [], []
    for (src, _), p, r, t in zip(convs, ids, out, temps, strict=True):
        if r and len(r) >= 4:
            seqs.append((p + r, len(p)))
            tags.append(f"{src}:{'g' if t == 0 else 's'}")

    _save_seqs(work / "train.npz", seqs, tags)  # saved now: the follow-ups below only add to it

    # 3. Multi-turn continuations of finished conversations.
    try:
        done = [i for i, r in enumerate(out) if r and len(r) >= 8 and r[-1] in chat.eos]
        rng.shuffle(done)
        cont = [prompt_mix.follow_up(convs[i][1], chat.decode(out[i] or []), rng) for i in done[: a.follow_ups]]
        cids = [chat.encode(c) for c in cont]
        cids = [p for p in cids if len(p) <= a.max_prompt + a.max_new]
        ctemps = [0.0 if rng.random() < a.greedy_share else 0.7 for _ in cids]
        cout = gen(cids, ctemps, a.max_new, deadline)
        for p, r, t in zip(cids, cout, ctemps, strict=True):
            if r and len(r) >= 4:
                seqs.append((p + r, len(p)))
                tags.append(f"multiturn:{'g' if t == 0 else 's'}")
    except Exception as exc:
        import traceback

        log(work, "follow-ups FAILED (the main set stands):", repr(exc), traceback.format_exc()[-1500:])
    _save_seqs(work / "train.npz", seqs, tags)
    counts: dict[str, int] = {}
    for t in tags:
        counts[t] = counts.get(t, 0) + 1
    summary = {
        "sequences": len(seqs),
        "response_tokens": int(sum(len(s) - p for s, p in seqs)),
        "generated_tokens": produced[0],
        "by_source": counts,
    }
    (work / "data.json").write_text(json.dumps(summary))
    log(work, "data", summary)


# train ------------------------------------------------------------------------------------------------------

SHIPPED = Path(__file__).resolve().parents[1] / "adapters" / "hf" / "drafters_data" / "default"
# Shapes: kind, layers, block size. `init` continues a shipped drafter (same shape, fresh optimizer); with `grow`
# the shipped weights start a larger drafter (more layers, a longer block, more target layers) that computes the
# shipped drafter's function at step 0. `lr` replaces --lr; any other key is a TrainPlan field (kl_weight, ...).
VARIANTS: dict[str, dict[str, Any]] = {
    "dspark-l1": {"kind": "dspark", "layers": 1, "block_size": 7},
    "dspark-l3": {"kind": "dspark", "layers": 3, "block_size": 7},
    "dspark-l5": {"kind": "dspark", "layers": 5, "block_size": 7},
    "dflash-l1": {"kind": "dflash", "layers": 1, "block_size": 8},
    "dflash-l3": {"kind": "dflash", "layers": 3, "block_size": 8},
    # The shipped drafters continued with this slot's data.
    "dspark-l1c": {"kind": "dspark", "layers": 1, "block_size": 7, "init": "dspark"},
    "dflash-l3c": {"kind": "dflash", "layers": 3, "block_size": 8, "init": "dflash"},
    # Soft targets against the control above: the same run with KL to the target's distribution.
    "dflash-l3c-kl": {"kind": "dflash", "layers": 3, "block_size": 8, "init": "dflash", "kl_weight": 0.5},
    "dspark-l1c-kl": {"kind": "dspark", "layers": 1, "block_size": 7, "init": "dspark", "kl_weight": 0.5},
    "dspark-l1c-g2": {"kind": "dspark", "layers": 1, "block_size": 7, "init": "dspark", "loss_gamma": 2.0},
    # The seed's sizes, grown from the shipped drafters (they start at the shipped τ instead of from scratch).
    # Their added layers start at zero and have all to learn: a higher peak than the continued runs' 5e-4.
    "dspark-l3g": {"kind": "dspark", "layers": 3, "block_size": 7, "init": "dspark", "grow": True, "lr": 8e-4},
    "dspark-l5g": {"kind": "dspark", "layers": 5, "block_size": 7, "init": "dspark", "grow": True, "lr": 8e-4},
    "dflash-b16g": {"kind": "dflash", "layers": 3, "block_size": 16, "init": "dflash", "grow": True, "lr": 6e-4},
    "dspark-f8g": {
        "kind": "dspark",
        "layers": 1,
        "block_size": 7,
        "init": "dspark",
        "grow": True,
        "target_layers": (1, 5, 8, 11, 14, 18, 21, 27),
    },
    # A larger target's first drafters (issue 28: Qwen2.5-Coder-1.5B, hidden 1,536, MLP 8,960): fresh, with an MLP
    # of 2x the hidden width (a round costs less; the checkpoint ~90 MB in bf16 instead of ~125), and a draft
    # vocabulary of 32k of Qwen's 152k (the top 8k cover 92% of code tokens, 32k 98.4%, measured on Python sources;
    # 7 draft rows of a 32k head cost ~3% of the 1.5B's step on a CPU where the full head costs ~15%).
    "dspark-l1-m3k": {"kind": "dspark", "layers": 1, "block_size": 7, "mlp_width": 3072, "draft_vocab": 32768},
    "dflash-l2-m3k": {"kind": "dflash", "layers": 2, "block_size": 8, "mlp_width": 3072, "draft_vocab": 32768},
}
SHAPE_KEYS = ("kind", "layers", "block_size", "init", "lr")


class _SlotTokenizer:
    """What the training use case reads of a tokenizer when the data is already made: the EOS ids."""

    def __init__(self, eos: list[int]) -> None:
        self.eos_ids = frozenset(eos)


def _plan(a: argparse.Namespace, work: Path, name: str) -> Any:
    from mlx_dspark.application.lab.training import TrainPlan, _auto_layers

    v = VARIANTS[name]
    staged = slot_target(Path(a.model))
    if "init" in v and staged["name"] != "default":
        raise SystemExit(
            f"{name} continues a drafter shipped for the default model; {staged['name']} trains fresh ones"
        )
    extra = {k: x for k, x in v.items() if k not in SHAPE_KEYS}
    return TrainPlan(
        kind=v["kind"],
        layers=v["layers"],
        block_size=v["block_size"],
        target_layers=tuple(extra.pop("target_layers", _auto_layers(staged["num_layers"]))),
        mask_token_id=int(staged["mask_token_id"]),
        draft_vocab=extra.pop("draft_vocab", 8192),
        markov_rank=32,
        lr=v.get("lr", a.lr),
        epochs=100,
        batch=a.batch,
        anchors=a.anchors,
        time_budget_s=a.train_seconds,
        stop_after_s=a.call_seconds,
        seed=a.seed,
        checkpoint_every=a.checkpoint_every,
        log_every=100,
        eval_every=a.eval_every,
        save_dtype="bfloat16",
        compile=not a.no_compile,
        compute_dtype=a.compute_dtype,
        profile_steps=a.profile_steps,
        init_from=str(SHIPPED / v["init"]) if "init" in v else None,
        **extra,
    )


def _gpu_name() -> str:
    """The GPU the slot ran on, for the model card (the lent machines are H200s or H100s)."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out.splitlines()[0].strip() if out else "GPU"


def train_one(a: argparse.Namespace, work: Path, name: str) -> None:
    """One variant through the training use case (`application/lab/training.py`: plan, checks, card, trainer),
    resumed from `work/NAME/training/` when an earlier call left it; the data is this slot's own."""
    import signal

    import attrs
    import mlx.core as mx

    from mlx_dspark.adapters.mlx.training import MlxDrafterTrainer
    from mlx_dspark.application.lab.training import DataOptions, TrainRequest, train_drafter
    from mlx_dspark.domain.model import TrainingTarget

    def stop(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # `timeout` ends the call: checkpoint and leave, the next call resumes

    signal.signal(signal.SIGTERM, stop)
    t0 = time.perf_counter()
    model = load_target(Path(a.model), a.dtype)
    train, tags = load_seqs(work / "train.npz")
    held, _ = load_seqs(work / "heldout.npz")
    chat_eos = [int(t) for t in json.loads((Path(a.model) / "config.json").read_text())["eos_token_id"]]
    staged = slot_target(Path(a.model))
    target = TrainingTarget(
        name=staged["name"],
        identity=staged["identity"],
        tokenizer=_SlotTokenizer(chat_eos),
        handle=model,
        tokenizer_size=int(staged["tokenizer_size"]),
        special_ids=tuple(staged["special_ids"]),
        reserved_ids=tuple(staged["reserved_ids"]),
    )  # type: ignore[arg-type]
    counts: dict[str, int] = {}
    for t in tags:
        src = t.split(":")[0]
        counts[src] = counts.get(src, 0) + 1
    note = (
        f"{len(train)} target responses generated in this slot (bf16 target on one {_gpu_name()}, lock-step generator; "
        f"by source: {', '.join(f'{k} {n}' for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))})"
    )

    def progress(p: Any) -> None:
        log(work, name, {k: (round(x, 4) if isinstance(x, float) else x) for k, x in p.items()})

    def run(plan: Any) -> dict[str, Any]:
        request = TrainRequest(
            target=staged["name"],
            out=str(work / name),
            plan=plan,
            data=DataOptions(),
            resume=True,
            sequences=(train, held),
            data_note=note,
        )
        trainer = MlxDrafterTrainer(lambda _n: target)
        return dict(train_drafter(trainer, request, say=lambda m: log(work, name, m), on_progress=progress))

    plan = _plan(a, work, name)
    if a.deadline:
        # Every variant of the call stops at the same moment (equal device time), whatever its start-up took.
        plan = attrs.evolve(plan, stop_after_s=max(5.0, a.deadline - time.time() - 5.0))
    log(work, name, "loaded in", round(time.perf_counter() - t0, 1), "s;", len(train), "sequences;", plan.stop_after_s)
    facts = None
    while facts is None:
        try:
            facts = run(plan)
        except KeyboardInterrupt:  # outside the training loop: the last checkpoint (if any) stands
            log(work, name, "interrupted outside the training loop; the last checkpoint stands")
            return
        except Exception as exc:
            import traceback

            left = (a.deadline - time.time() - 5.0) if a.deadline else (a.call_seconds or a.train_seconds)
            left = max(5.0, left - (time.perf_counter() - t0))
            if "out of memory" in str(exc) and plan.batch > 8:
                # Two runs side by side on a 1.5B target's 151,936-token vocabulary outgrew an 80 GB H100
                # (2026-12-07): the run goes on at half the batch instead of leaving the slot without it.
                log(work, name, f"out of memory at batch {plan.batch}, retrying at {plan.batch // 2}:", repr(exc))
                mx.clear_cache()
                plan = attrs.evolve(plan, batch=plan.batch // 2, stop_after_s=left)
            elif plan.compile:  # a compile failure must not cost the slot: the same run, uncompiled
                log(work, name, "compiled run failed, retrying uncompiled:", repr(exc), traceback.format_exc()[-1500:])
                plan = attrs.evolve(plan, compile=False, stop_after_s=left)
            else:
                raise
    facts = {k: x for k, x in facts.items() if k != "config"}
    facts["wall_s"] = time.perf_counter() - t0
    facts["device"] = str(mx.default_device())
    facts["variant"] = {k: x for k, x in VARIANTS[name].items()}
    (work / name / "facts.json").write_text(json.dumps(facts, default=str))
    log(work, name, "done", json.dumps({k: facts.get(k) for k in ("steps", "total_steps", "tau_estimate")}))


def train(a: argparse.Namespace, work: Path) -> None:
    """Every variant in its own process, side by side on the one GPU (equal wall time), then the curve."""
    import signal

    procs = []
    for name in a.variants.split(","):
        cmd = [sys.executable, __file__, "train-one", "--variant", name, *sys.argv[2:]]
        out = (work / f"{name}.log").open("a")
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))

    def forward(sig: int, _frame: Any) -> None:  # `timeout` ends the call: every run checkpoints and leaves
        for p in procs:
            p.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    for p in procs:
        p.wait()
    log(work, "train: exit codes", [p.returncode for p in procs])
    curve(a, work)


def curve(a: argparse.Namespace, work: Path) -> None:
    """The learning-curve rows of this slot (`curve.json`): per variant, τ on the held-out responses against
    block tokens and training seconds at every evaluation, with the run's throughput and profile."""
    rows = []
    data = json.loads((work / "data.json").read_text()) if (work / "data.json").is_file() else {}
    for name in a.variants.split(","):
        f = work / name / "facts.json"
        if not f.is_file():
            rows.append({"variant": name, "missing": True})
            continue
        facts = json.loads(f.read_text())
        rows.append(
            {
                "variant": name,
                **{k: facts.get(k) for k in ("steps", "total_steps", "block_tokens", "tau_estimate", "finished")},
                "slot_accuracy": facts.get("slot_accuracy"),
                "curve": facts.get("curve"),
                "block_tokens_per_s": facts.get("block_tokens_per_s"),
                "profile": facts.get("profile"),
                "continued_from": facts.get("continued_from"),
                "spec": VARIANTS[name],
            }
        )
    doc = {"slot": a.slot, "data": data, "batch": a.batch, "anchors": a.anchors, "rows": rows}
    (work / "curve.json").write_text(json.dumps(doc, indent=1, default=str))
    log(work, "curve", json.dumps([(r["variant"], r.get("tau_estimate"), r.get("block_tokens")) for r in rows]))


def profile(a: argparse.Namespace, work: Path) -> None:
    """Each variant alone for a few dozen steps (no other run on the GPU): block tokens/s, steps/s and the split
    between the target-side forward and the drafter step, per compute dtype; nothing is kept."""
    import shutil

    import attrs

    from mlx_dspark.adapters.mlx.training import MlxDrafterTrainer

    class _Target:
        handle = load_target(Path(a.model), a.dtype)

    train_seqs, _ = load_seqs(work / "train.npz")
    held, _ = load_seqs(work / "heldout.npz")
    report = {}
    for name in a.variants.split(","):
        for dtype in a.profile_dtypes.split(","):
            plan = attrs.evolve(
                _plan(a, work, name),
                compute_dtype=dtype,
                profile_steps=a.profile_steps or 20,
                max_steps=8 + 2 * (a.profile_steps or 20) + 1,
                time_budget_s=None,
                stop_after_s=None,
                eval_every=0,
                checkpoint_every=10**9,
            )
            out = work / f"profile-{name}-{dtype}"
            t0 = time.perf_counter()
            plan = attrs.evolve(plan, always_draft=(0, 2))
            facts = MlxDrafterTrainer(lambda _n: _Target()).train(
                _Target(), plan, train_seqs[:20000], held[:4], out_dir=str(out), resume=False, card=str
            )
            report[f"{name}/{dtype}"] = {**(facts.get("profile") or {}), "wall_s": time.perf_counter() - t0}
            log(work, "profile", name, dtype, report[f"{name}/{dtype}"])
            shutil.rmtree(out, ignore_errors=True)
    (work / "profile.json").write_text(json.dumps(report, indent=1))


# bench ------------------------------------------------------------------------------------------------------


def bench(a: argparse.Namespace, work: Path) -> None:
    import mlx.core as mx

    from mlx_dspark.adapters.mlx.drafters import load_drafter
    from mlx_dspark.adapters.mlx.target import MlxTargetModel
    from mlx_dspark.application.engine import decode
    from mlx_dspark.domain.costmodel.draft_cap import FixedCap
    from mlx_dspark.domain.events import RoundFinished, TokensCommitted
    from mlx_dspark.domain.tokens import SamplingParams, StopRule

    class Clock:
        def now(self) -> float:
            return time.perf_counter()

    chat = Chat(Path(a.model))
    model = load_target(Path(a.model), a.dtype)
    target = MlxTargetModel(model)
    sources: dict[str, Any] = {"plain": None}
    for name in a.bench_drafters.split(","):
        if (work / name / "config.json").is_file():
            kind = name.split("-")[0]
            sources[name] = load_drafter(kind, str(work / name), model, target=target, bits=0)
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in sources}
    held = heldout()
    t_bench = time.perf_counter()
    for rep in range(2):  # the first pass (a few prompts) warms every shape
        for p in held[:2] if a.smoke or rep == 0 else held:
            if rep == 1 and time.perf_counter() - t_bench > a.bench_seconds:
                break
            ids = chat.encode([{"role": "user", "content": p["prompt"]}])
            for name, src in sources.items():
                target.reset(0)
                if src is not None:
                    src.begin(ids)
                toks, rounds = [], 0
                t = time.perf_counter()
                first = None
                for ev in decode(
                    target,
                    ids,
                    SamplingParams(temperature=0.0),
                    StopRule(max_tokens=8 if a.smoke else 128, eos_ids=frozenset(chat.eos)),
                    Clock(),
                    source=src,
                    cap_policy=None if src is None else FixedCap(7),
                ):
                    if isinstance(ev, TokensCommitted):
                        if first is None:
                            first = time.perf_counter()
                        toks.extend(ev.tokens)
                    if isinstance(ev, RoundFinished):
                        rounds += 1
                mx.synchronize()
                dt = time.perf_counter() - (first or t)
                if rep == 1:
                    rows[name].append(
                        {
                            "id": p["id"],
                            "tokens": len(toks),
                            "decode_tok_s": (len(toks) - 1) / max(dt, 1e-9),
                            "rounds": rounds,
                            "ids": toks,
                        }
                    )
    plain = {r["id"]: r for r in rows["plain"]}
    summary = {}
    for name, rs in rows.items():
        summary[name] = {
            "median_decode_tok_s": float(np.median([r["decode_tok_s"] for r in rs])),
            "identical_to_plain": sum(r["ids"] == plain[r["id"]]["ids"] for r in rs),
            "mean_accepted_per_round": float(np.mean([(r["tokens"] - 1) / max(1, r["rounds"]) for r in rs])),
            "prompts": len(rs),
        }
    (work / "bench.json").write_text(json.dumps(summary))
    log(work, "bench", summary)


def pack_data(a: argparse.Namespace, work: Path) -> None:
    """This slot's data for the way back (a later slot can train on it without generating): the token ids as
    uint16 (uint32 for a vocabulary past 65,536: Qwen's 151,936) in one compressed npz, cut into <= 15 MiB pieces
    (`cat data.npz.* > data.npz` joins them)."""
    import io

    out = Path(a.pack_to)
    buf = io.BytesIO()
    parts = {}
    for name in ("train", "heldout"):
        z = np.load(work / f"{name}.npz")
        parts.update({f"{name}_{k}": z[k] for k in z.files})
        ids = z["ids"]
        parts[f"{name}_ids"] = ids.astype(np.uint16 if ids.size == 0 or int(ids.max()) < 1 << 16 else np.uint32)
    np.savez_compressed(buf, **parts)
    blob, piece = buf.getvalue(), 15 << 20
    for i in range(0, len(blob), piece):
        (out / f"data.npz.{i // piece}").write_bytes(blob[i : i + piece])
    log(work, "pack-data:", len(blob), "bytes in", -(-len(blob) // piece), "pieces")


def unpack_data(a: argparse.Namespace, work: Path) -> None:
    """The inverse of pack_data: train.npz and heldout.npz in --work from a joined data.npz (--data-file)."""
    z = np.load(a.data_file)
    for name in ("train", "heldout"):
        keys = [k for k in z.files if k.startswith(name + "_")]
        arrays = {k[len(name) + 1 :]: z[k] for k in keys}
        arrays["ids"] = arrays["ids"].astype(np.int32)
        np.savez(work / f"{name}.npz", **arrays)


def merge_data(a: argparse.Namespace, work: Path) -> None:
    """Add the training sequences of earlier slots' data.npz files (--data-file, comma-separated) to this work's
    train.npz: a slot that continues the last trains on all the data made so far. Their held-out responses are
    not added (this slot keeps its own held-out set; a prompt held out anywhere never enters training)."""
    seqs, tags = load_seqs(work / "train.npz")
    held = {tuple(s) for s, _ in load_seqs(work / "heldout.npz")[0]}
    before = len(seqs)
    for name in a.data_file.split(","):
        z = np.load(name)
        ends = np.cumsum(z["train_lens"])
        ids = z["train_ids"].astype(np.int32)
        for s, e, p, t in zip(ends - z["train_lens"], ends, z["train_prompt_lens"], z["train_tags"], strict=True):
            seq = ids[s:e].tolist()
            if tuple(seq) not in held:
                seqs.append((seq, int(p)))
                tags.append(f"prev:{t}")
    _save_seqs(work / "train.npz", seqs, tags)
    log(work, "merge-data:", before, "sequences of this slot +", len(seqs) - before, "from", a.data_file)


PHASES = {
    "diag": diag,
    "data": data,
    "train": train,
    "profile": profile,
    "curve": curve,
    "bench": bench,
    "pack-data": pack_data,
    "unpack-data": unpack_data,
    "merge-data": merge_data,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "phase",
        choices=(*PHASES, "train-one", "all", "export"),
    )
    p.add_argument("--model", required=True)
    p.add_argument("--work", default="work")
    p.add_argument("--gguf")
    p.add_argument("--name", help="export: the target's name in this project (default: the default model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=130000)
    p.add_argument("--self-instruct", type=int, default=20000)
    p.add_argument("--follow-ups", type=int, default=25000)
    p.add_argument("--gen-seconds", type=float, default=420)
    p.add_argument("--follow-seconds", type=float, default=90)
    p.add_argument("--gen-batch", type=int, default=512)
    p.add_argument("--max-new", type=int, default=160)
    p.add_argument("--max-prompt", type=int, default=640)
    p.add_argument("--greedy-share", type=float, default=0.6)
    p.add_argument("--temperatures", type=lambda x: [float(t) for t in x.split(",")], default=[0.6, 0.7, 0.8, 1.0])
    p.add_argument(
        "--top-p-choices",
        type=lambda x: [float(t) for t in x.split(",")],
        default=[0.8, 0.9, 0.95, 1.0],
        help="nucleus cuts drawn per prompt; all 1.0 skips the vocabulary sort (the sampler's dearest part)",
    )
    p.add_argument("--diag-batches", default="256,512,1024")
    p.add_argument("--diag-exact", type=int, default=1, help="0 skips the exactness checks (done in an earlier slot)")
    p.add_argument("--train-seconds", type=float, default=420, help="training seconds of the whole run (all calls)")
    p.add_argument("--call-seconds", type=float, help="this call's training seconds; the next call resumes")
    p.add_argument("--deadline", type=float, help="epoch seconds at which this call's runs stop (all at once)")
    p.add_argument("--pack-to", help="pack-data: the folder that comes back")
    p.add_argument("--data-file", help="unpack-data: a joined data.npz from an earlier slot")
    p.add_argument("--heldout", type=int, default=0, help="data: held-out responses to write (0 = all 30)")
    p.add_argument("--variants", default="dspark-l1c,dflash-l3c")
    p.add_argument("--variant")
    p.add_argument("--bench-drafters", default="dspark-l1c,dflash-l3c")
    p.add_argument("--bench-seconds", type=float, default=150)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints")
    p.add_argument("--eval-every", type=int, default=500, help="steps between held-out τ points of the curve")
    p.add_argument("--compute-dtype", default="float32", help="drafter forward/backward: float32 or bfloat16")
    p.add_argument("--profile-steps", type=int, default=20, help="steps timed part by part in each run")
    p.add_argument("--profile-dtypes", default="float32,bfloat16", help="the profile phase's compute dtypes")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--slot", type=int, default=3, help="this slot's number in the campaign (the curve's rows)")
    p.add_argument("--dtype", default="bfloat16", help="target compute dtype for data, training and bench")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for a CPU run of every phase")
    a = p.parse_args()
    if a.smoke:
        from mlx_dspark.adapters.mlx.blas import ensure_fast_blas

        ensure_fast_blas()  # the optimized CPU BLAS, as every CPU entrypoint does (before mlx.core loads)
    if a.phase == "export":
        export_target(a.gguf, a.model, a.name)
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if a.phase == "train-one":
        train_one(a, work, a.variant)
        return
    phases = ["diag", "data", "train", "bench"] if a.phase == "all" else [a.phase]
    for ph in phases:
        log(work, "phase", ph)
        try:
            PHASES[ph](a, work)
            import gc

            import mlx.core as mx

            gc.collect()
            mx.clear_cache()
        except Exception as exc:  # keep going: a failed diagnostic must not cost the slot
            import traceback

            log(work, "phase", ph, "FAILED", repr(exc), traceback.format_exc()[-3000:])
            if ph in ("data",):
                raise


if __name__ == "__main__":
    main()
