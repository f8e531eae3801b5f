"""`MlxDrafterTrainer`: the MLX side of drafter distillation (the `DrafterTrainer` port).

It builds the drafter from the project's own modules (`adapters/mlx/drafters`: the same forward the loaders
use at inference), computes the frozen target's features on the fly for every step, and trains with AdamW
(linear warmup, cosine decay, gradient clipping). The published checkpoint and the resumable state are
written together every `checkpoint_every` steps, at the end, and on Ctrl-C.

The plan object is read by attribute (it is the application's `TrainPlan`; adapters never import it).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlx_dspark.adapters.mlx import model_parts
from mlx_dspark.adapters.mlx.drafters.backbone import BlockwiseMask
from mlx_dspark.adapters.mlx.drafters.config import parse_dflash, parse_dspark
from mlx_dspark.adapters.mlx.drafters.dflash import DFlashDrafter
from mlx_dspark.adapters.mlx.drafters.dspark import DSparkDrafter
from mlx_dspark.adapters.mlx.drafters.heads import target_embedding, target_head
from mlx_dspark.adapters.mlx.training import checkpoints
from mlx_dspark.adapters.mlx.training.features import capture, head_rows
from mlx_dspark.adapters.mlx.training.generate import generate_responses
from mlx_dspark.adapters.mlx.training.recipe import (
    IGNORE,
    AnchorBatch,
    BlockLayout,
    TrainSequence,
    anchor_batch,
    dflash_loss,
    dspark_loss,
    expand,
    response_window,
    teacher_forced_tau,
)

Progress = Callable[[Mapping[str, Any]], None]
EVAL_SEED = 1234  # held-out anchors are the same at every evaluation


def drafter_config(plan: Any, model: nn.Module) -> dict[str, Any]:
    """The published `config.json` of a new drafter for `model` (z-lab DFlash or DeepSpec DSpark layout).

    Layer shapes are the target's (the drafter shares its width, embedding and head), as in the published
    drafters; `num_hidden_layers`, `block_size`, the target layers and a narrower MLP come from the plan.
    """
    args = model_parts.model_args(model)
    hidden = model_parts.hidden_size(model)
    heads = int(args.num_attention_heads)
    common = {
        "model_type": "qwen3",
        "hidden_size": hidden,
        # The drafter's own MLP width: the plan's, else the target's (LFM2 names it block_ff_dim), else 4x.
        "intermediate_size": int(
            getattr(plan, "mlp_width", 0)
            or next(
                (v for v in (getattr(args, k, None) for k in ("intermediate_size", "block_ff_dim", "ffn_dim")) if v),
                4 * hidden,
            )
        ),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(args, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(args, "head_dim", None) or hidden // heads),
        "num_hidden_layers": int(plan.layers),
        "rms_norm_eps": float(getattr(args, "rms_norm_eps", 1e-6)),
        "rope_theta": float(getattr(args, "rope_theta", 10000.0)),
        "max_position_embeddings": int(getattr(args, "max_position_embeddings", 8192) or 8192),
        "attention_bias": False,
        "vocab_size": model_parts.vocab_size(model),
        "num_target_layers": model_parts.num_layers(model),
        "layer_types": ["full_attention"] * int(plan.layers),
    }
    if plan.kind == "dflash":
        out_dflash: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            **common,
            "block_size": int(plan.block_size),
            "dflash_config": {"mask_token_id": int(plan.mask_token_id), "target_layer_ids": list(plan.target_layers)},
            "tie_word_embeddings": True,
        }
        if plan.draft_vocab:
            out_dflash["dflash_config"]["draft_vocab_size"] = int(plan.draft_vocab)
        return out_dflash
    out = {
        "architectures": ["Qwen3DSparkModel"],
        **common,
        "block_size": int(plan.block_size),
        "mask_token_id": int(plan.mask_token_id),
        "target_layer_ids": list(plan.target_layers),
        "num_anchors": int(plan.anchors),
        "markov_rank": int(plan.markov_rank),
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": bool(plan.markov_rank),
        "tie_word_embeddings": False,
    }
    if plan.draft_vocab:
        out["draft_vocab_size"] = int(plan.draft_vocab)
    return out


def draft_vocabulary(sequences: Sequence[TrainSequence], size: int, vocab: int, always: Sequence[int]) -> np.ndarray:
    """The `size` most frequent response tokens (ties by id), plus `always` (EOS), sorted by id."""
    counts = np.zeros(vocab, dtype=np.int64)
    for s in sequences:
        np.add.at(counts, np.asarray(s.tokens[s.prompt_len :], dtype=np.int64), 1)
    counts[list(always)] = counts.max() + 1
    order = np.lexsort((np.arange(vocab), -counts))[:size]
    return np.sort(order)


def build_drafter(plan: Any, model: nn.Module, draft_ids: np.ndarray | None) -> tuple[nn.Module, dict[str, Any]]:
    """A freshly initialised drafter module (the inference class itself) and its published config.

    Initialisation: random layers (seeded), the final norm copied from the target's, and for DSpark a
    frozen `lm_head` holding the target head's rows of the draft vocabulary.
    """
    config = drafter_config(plan, model)
    mx.random.seed(int(plan.seed))
    embed = target_embedding(model, None)
    drafter: nn.Module
    vocab = model_parts.vocab_size(model)
    d2t = None if draft_ids is None else mx.array(draft_ids - np.arange(len(draft_ids)), dtype=mx.int32)
    if plan.kind == "dflash":
        drafter = DFlashDrafter(
            parse_dflash(config), embed_fn=embed, head_fn=target_head(model, None, None), vocab_size=vocab, d2t=d2t
        )
        if draft_ids is not None:
            drafter.lm_head.weight = head_rows(model, draft_ids.tolist())
            drafter.lm_head.freeze()
    else:
        ids = np.arange(vocab) if draft_ids is None else draft_ids
        drafter = DSparkDrafter(
            parse_dspark(config), vocab_size=vocab, embed_fn=embed, own_embedding=False, own_head=True, d2t=d2t
        )
        drafter.lm_head.weight = head_rows(model, ids.tolist())
        drafter.lm_head.freeze()
    # A copy, never the target's own array (a float32 target's astype returns it): a compiled step takes the
    # drafter's weights as inputs and the target's as constants, and one array cannot be both.
    drafter.norm.weight = mx.array(np.array(model_parts.final_norm(model).weight.astype(mx.float32)))
    drafter.set_dtype(mx.float32)
    mx.eval(drafter.parameters())
    return drafter, config


def published_weights(drafter: nn.Module, draft_ids: np.ndarray | None) -> dict[str, mx.array]:
    """Tensors under their published names (+ the speculators-style `d2t` offsets for a reduced vocabulary)."""
    weights = dict(tree_flatten(drafter.parameters()))
    if draft_ids is not None:
        # A reduced head is the target head's rows of the draft ids: loaders rebuild it from the target.
        weights.pop("lm_head.weight", None)
        weights["d2t"] = mx.array(draft_ids - np.arange(len(draft_ids)), dtype=mx.int64)
    return weights


def committed_start(plan: Any, out: Path, resume: bool) -> Path | None:
    """The published checkpoint a run starts from: `plan.init_from`, or with `resume` the one in `out`
    when `out` holds no resumable state (a committed drafter continued with new data in a later slot)."""
    if getattr(plan, "init_from", None):
        return Path(plan.init_from)
    if resume and checkpoints.load_state(out) is None and (out / "config.json").is_file():
        return out
    return None


def _committed(plan: Any, where: Path) -> tuple[Any, np.ndarray | None, dict[str, mx.array]]:
    """(the plan with the committed drafter's shape, its draft vocabulary, its weights in float32).

    The shape (layers, block, target layers, mask token, Markov rank, draft vocabulary) is the checkpoint's:
    new data continues the same drafter. With `plan.grow` the plan's layers, block size and target layers
    stay (`grown_weights` fits the checkpoint into them); mask token, Markov rank and vocabulary stay the
    checkpoint's.
    """
    import attrs

    raw = json.loads((where / "config.json").read_text())
    loaded = mx.load(str(where / "model.safetensors"))
    assert isinstance(loaded, dict)
    kind = "dspark" if "markov_rank" in raw else "dflash"
    if kind != plan.kind:
        raise ValueError(f"{where} holds a {kind} drafter, not {plan.kind}")
    dcfg = raw.get("dflash_config") or {}
    d2t = loaded.pop("d2t", None)
    draft_ids = None if d2t is None else (np.arange(d2t.shape[0]) + np.array(d2t)).astype(np.int64)
    shape = {
        "layers": int(raw["num_hidden_layers"]),
        "block_size": int(raw["block_size"]),
        "target_layers": tuple(dcfg.get("target_layer_ids") or raw["target_layer_ids"]),
    }
    if getattr(plan, "grow", False):
        if int(plan.layers) < shape["layers"] or not set(shape["target_layers"]) <= set(plan.target_layers or ()):
            raise ValueError(
                f"grow: {plan.layers} layers over target layers {list(plan.target_layers)} cannot hold {where}'s "
                f"{shape['layers']} layers over {list(shape['target_layers'])}"
            )
        shape = {}
    plan = attrs.evolve(
        plan,
        **shape,
        mask_token_id=int(dcfg.get("mask_token_id", raw.get("mask_token_id", 0))),
        markov_rank=int(raw.get("markov_rank", plan.markov_rank)),
        draft_vocab=0 if draft_ids is None else len(draft_ids),
    )
    weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in loaded.items()}
    weights["_target_layers"] = mx.array(list(dcfg.get("target_layer_ids") or raw["target_layer_ids"]))
    return plan, draft_ids, weights


def grown_weights(fresh: Mapping[str, mx.array], old: Mapping[str, mx.array], plan: Any) -> dict[str, mx.array]:
    """A checkpoint's weights fitted into a drafter with more layers and/or more target layers, computing the
    checkpoint's function at step 0: its layers come first, each added layer starts with zero output
    projections (`o_proj`, `down_proj`: the residual passes through), and `fc` gets zero columns for the added
    target layers' features.

    Args:
        fresh: the new drafter's freshly initialised parameters (flattened).
        old: the checkpoint's (flattened, with `_target_layers`, the checkpoint's target layer ids).
        plan: the new drafter's plan (layers, target layers).
    """
    out = dict(fresh)
    old_layers = [int(x) for x in np.array(old["_target_layers"]).tolist()]
    for name, value in old.items():
        if name.startswith("_"):
            continue
        if name == "fc.weight":
            width = value.shape[1] // len(old_layers)
            cols = [mx.zeros((value.shape[0], width), dtype=value.dtype)] * len(plan.target_layers)
            for j, layer in enumerate(old_layers):
                cols[list(plan.target_layers).index(layer)] = value[:, j * width : (j + 1) * width]
            out[name] = mx.concatenate(cols, axis=1)
        else:
            out[name] = value
    have = {int(n.split(".")[1]) for n in old if n.startswith("layers.")}
    zeroed = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    for name in fresh:
        if name.startswith("layers.") and int(name.split(".")[1]) not in have and name.endswith(zeroed):
            out[name] = mx.zeros_like(fresh[name])
    return out


def _own_prev_mask(seed: int, step: int, shape: tuple[int, int], share: float) -> np.ndarray:
    """Blocks whose Markov inputs are the drafter's own earlier drafts this step (a stream of its own, so the
    run's anchor draws stay the same with and without)."""
    return np.random.default_rng([seed, 7919, step]).random(shape) < share


class _Step:
    """One kind's loss over a device batch, and the teacher-forced evaluation of held-out blocks.

    Everything here runs on the device (inside the compiled step): the block layout from the anchors
    (`expand`), one frozen-target forward per sequence for the features every anchor of it reads, the
    target's next-token distribution once per response row (not once per anchor slot), and the loss.
    """

    def __init__(self, plan: Any, model: nn.Module, layout: BlockLayout, draft_ids: np.ndarray | None) -> None:
        self.kind = plan.kind
        self.model = model
        self.layout = layout
        self.layer_ids = tuple(plan.target_layers)
        self.mask_token_id = int(plan.mask_token_id)
        self.kl_weight = float(getattr(plan, "kl_weight", 0.0) or 0.0)
        self.own_prev = float(getattr(plan, "own_prev", 0.0) or 0.0) if plan.kind == "dspark" else 0.0
        self.needs_teacher = self.kind == "dspark" or self.kl_weight > 0
        vocab = model_parts.vocab_size(model)
        self.draft_ids = None if draft_ids is None else mx.array(draft_ids, dtype=mx.int32)
        t2d = np.full(vocab, IGNORE, dtype=np.int32)
        if draft_ids is not None:
            t2d[draft_ids] = np.arange(len(draft_ids), dtype=np.int32)
        else:
            t2d = np.arange(vocab, dtype=np.int32)
        self.t2d = mx.array(t2d)

    def _draft_labels(self, labels: mx.array) -> mx.array:
        """Labels as draft-vocabulary ids (IGNORE where unsupervised or outside the draft vocabulary)."""
        if self.draft_ids is None:
            return labels
        return mx.where(labels != IGNORE, self.t2d[mx.maximum(labels, 0)], IGNORE)

    def _teacher(self, final: mx.array, ex: Mapping[str, mx.array], window: mx.array) -> dict[str, mx.array]:
        """The target's next-token distribution at every supervised slot, computed once per response row (or once
        per slot, when the anchors' slots are fewer than the response rows).

        DSpark's L1 needs the probabilities over the draft vocabulary and the mass outside it (a full-vocabulary
        softmax); the KL needs the distribution renormalized over the draft vocabulary.
        """
        idx = ex["window_index"]
        b, n, slots = idx.shape
        per_slot = n * slots <= window.shape[1]  # few anchors: the slots' own rows are fewer than the window's
        rows_at = ex["target_rows"].reshape(b, -1) if per_slot else window
        hidden = mx.take_along_axis(final, rows_at[..., None], axis=1)  # [B, R, H]
        logits = model_parts.lm_head(self.model, hidden)
        drafted = logits if self.draft_ids is None else mx.take(logits, self.draft_ids, axis=-1)
        drafted = drafted.astype(mx.float32)
        rows: dict[str, mx.array] = {}
        if self.kind == "dspark":
            lse = mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
            probs = mx.exp(drafted - lse)
            rows["teacher"] = probs
            rows["outside"] = mx.maximum(1.0 - probs.sum(axis=-1), 0.0)
        if self.kl_weight > 0 and self.kind == "dflash":
            rows["soft"] = mx.softmax(drafted, axis=-1)
        flat = idx.reshape(b, -1)
        out = {}
        for name, value in rows.items():
            if per_slot:
                got = value.reshape(b, n, slots, *value.shape[2:])
            elif value.ndim == 3:
                got = mx.take_along_axis(value, flat[..., None], axis=1).reshape(b, n, slots, value.shape[-1])
            else:
                got = mx.take_along_axis(value, flat, axis=1).reshape(b, n, slots)
            out[name] = mx.stop_gradient(got)
        return out

    def inputs(self, dev: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """The block layout and the frozen-target inputs of the loss: features, and the teacher."""
        ex = expand(dev, self.layout, self.mask_token_id)
        feats, final = capture(self.model, dev["ctx_ids"], self.layer_ids, final=self.needs_teacher)
        out = {**ex, "feats": feats}
        if final is not None:
            out.update(self._teacher(final, ex, dev["window"]))
        out["labels_draft"] = self._draft_labels(ex["labels"])
        if "own" in dev:
            out["own"] = dev["own"]
        return out

    def slot_logits(self, drafter: nn.Module, extra: Mapping[str, mx.array]) -> tuple[mx.array, Any]:
        """Logits [B, N, slots, V] of the supervised slots (DSpark: Markov-corrected) and the hidden rows."""
        ctx = drafter.context_kv(drafter.fuse(extra["feats"]), 0)
        bs = self.layout.block_size
        mask = BlockwiseMask(extra["visible"], bs)
        h = drafter.hidden(drafter.embed_block(extra["block_ids"]), extra["positions"], context=ctx, masks=mask)
        b, q, width = h.shape
        h = h.reshape(b, q // bs, bs, width)[:, :, self.layout.first_slot :, :]
        if self.kind == "dflash":
            return drafter.logits(h), (h, None)
        base = drafter.base_logits(h)
        prev_ids = extra["prev_ids"]
        if "own" in extra:
            prev_ids = mx.where(extra["own"][..., None], self._own_drafts(drafter, base, prev_ids), prev_ids)
        prev = drafter.prev_embedding(prev_ids)
        return drafter.corrected(base, prev), (h, prev)

    @staticmethod
    def _own_drafts(drafter: nn.Module, base: mx.array, prev_ids: mx.array) -> mx.array:
        """Markov inputs as at inference: slot 0 reads the anchor, slot k the drafter's own greedy draft at
        slot k − 1 (chained through the Markov head, without gradient)."""
        base = mx.stop_gradient(base)
        prev = prev_ids[..., 0]
        chain = [prev]
        for k in range(base.shape[-2] - 1):
            x = mx.argmax(drafter.corrected(base[..., k, :], drafter.prev_embedding(prev)), axis=-1)
            prev = drafter.to_target_ids(x)
            chain.append(prev)
        return mx.stop_gradient(mx.stack(chain, axis=-1))

    def loss(self, drafter: nn.Module, extra: Mapping[str, mx.array]) -> Any:
        logits, (h, prev) = self.slot_logits(drafter, extra)
        if self.kind == "dflash":
            return dflash_loss(
                logits,
                extra["labels_draft"],
                self.layout,
                teacher=extra.get("soft"),
                supervised=extra["labels"],
                kl_weight=self.kl_weight,
            )
        conf = drafter.confidence_logit(h, prev)
        return dspark_loss(
            logits,
            conf,
            extra["labels_draft"],
            extra["labels"],
            extra["teacher"],
            extra["outside"],
            self.layout,
            kl_weight=self.kl_weight,
        )

    def hits(self, drafter: nn.Module, dev: Mapping[str, mx.array]) -> tuple[np.ndarray, np.ndarray]:
        """Per held-out block and slot: argmax == label (greedy, teacher-forced), and whether supervised."""
        extra = self.inputs({k: v for k, v in dev.items() if k != "own"})
        logits, _ = self.slot_logits(drafter, extra)
        guess = mx.argmax(logits, axis=-1)
        hit = np.array(guess == extra["labels_draft"])
        sup = np.array(extra["labels"] != IGNORE)
        return hit.reshape(-1, hit.shape[-1]), sup.reshape(-1, sup.shape[-1])


class MlxDrafterTrainer:
    """The `DrafterTrainer` port over MLX (CPU or CUDA/Metal: the same code).

    Args:
        open_target: loads a target by name (wired in bootstrap from the HF loader).
    """

    def __init__(self, open_target: Callable[[str], Any]) -> None:
        self._open = open_target

    def open_target(self, name: str) -> Any:
        return self._open(name)

    def describe(self, target: Any) -> dict[str, Any]:
        """Target facts the plan needs: decoder layers, width, embedding rows, device."""
        model = target.handle
        return {
            "num_layers": model_parts.num_layers(model),
            "hidden_size": model_parts.hidden_size(model),
            "vocab_size": model_parts.vocab_size(model),
            "embedding_rows": int(model_parts.embedding(model).weight.shape[0]),
            "device": str(mx.default_device()),
        }

    def generate(
        self,
        target: Any,
        prompts: Sequence[Sequence[int]],
        *,
        eos_ids: Sequence[int],
        max_new_tokens: int,
        batch: int,
        temperatures: Sequence[float],
        top_p: float,
        seed: int,
        time_budget_s: float | None,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> list[list[int] | None]:
        """Target responses in batches (see `generate_responses`)."""
        deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
        return generate_responses(
            target.handle,
            prompts,
            eos_ids=eos_ids,
            max_new_tokens=max_new_tokens,
            batch=batch,
            temperatures=temperatures,
            top_p=top_p,
            seed=seed,
            deadline=deadline,
            progress=progress,
        )

    def train(
        self,
        target: Any,
        plan: Any,
        sequences: Sequence[tuple[Sequence[int], int]],
        heldout: Sequence[tuple[Sequence[int], int]],
        *,
        out_dir: str,
        resume: bool,
        card: Callable[[Mapping[str, Any]], str],
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        """Train (or resume) a drafter and write its checkpoint to `out_dir`.

        Args:
            target: the opened target.
            plan: the application's TrainPlan.
            sequences: (tokens, prompt length) of the training set, in a fixed order.
            heldout: the same for the teacher-forced evaluation.
            out_dir: checkpoint directory.
            resume: continue from `out_dir/training/` when it exists.
            card: renders the model card from the run's facts.
            progress: receives a mapping per logged step (step, total, loss, tokens_per_s, eta_s, ...).

        Returns:
            Facts of the run: steps, total_steps, tokens, loss, tau_estimate, interrupted, ...
        """
        return _Run(target.handle, plan, sequences, heldout, Path(out_dir), card, progress, resume).run(resume)


class _Pending:
    """A step queued on the device: its loss and accuracy are read (a host sync) only one step later."""

    def __init__(self, step: int, loss: mx.array, acc: mx.array) -> None:
        self.step, self.loss, self.acc = step, loss, acc


class _Run:
    def __init__(
        self,
        model: nn.Module,
        plan: Any,
        sequences: Sequence[tuple[Sequence[int], int]],
        heldout: Sequence[tuple[Sequence[int], int]],
        out: Path,
        card: Callable[[Mapping[str, Any]], str],
        progress: Progress | None,
        resume: bool = False,
    ) -> None:
        model.eval()
        model.freeze()
        self.model, self.plan, self.out, self.card, self.progress = model, plan, out, card, progress
        self.data = [TrainSequence(tokens=tuple(int(t) for t in s), prompt_len=int(p)) for s, p in sequences]
        self.heldout = [TrainSequence(tokens=tuple(int(t) for t in s), prompt_len=int(p)) for s, p in heldout]
        self.lengths = np.array([len(x.tokens) for x in self.data], dtype=np.int64)
        vocab = model_parts.vocab_size(model)
        self.draft_ids = None
        self.init_from = committed_start(plan, out, resume)
        init_weights: dict[str, mx.array] | None = None
        if self.init_from is not None:
            plan, self.draft_ids, init_weights = _committed(plan, self.init_from)
            self.plan = plan
        elif plan.draft_vocab and plan.draft_vocab < vocab:
            self.draft_ids = draft_vocabulary(self.data, int(plan.draft_vocab), vocab, plan.always_draft)
        gamma = float(getattr(plan, "loss_gamma", 0.0) or 0.0) or None
        self.layout = BlockLayout.for_kind(plan.kind, int(plan.block_size), gamma)
        self.drafter, self.config = build_drafter(plan, model, self.draft_ids)
        if init_weights is not None:
            if self.draft_ids is not None and "lm_head.weight" not in init_weights:
                init_weights["lm_head.weight"] = self.drafter.lm_head.weight
            if getattr(plan, "grow", False):
                init_weights = grown_weights(dict(tree_flatten(self.drafter.parameters())), init_weights, plan)
            init_weights.pop("_target_layers", None)
            self.drafter.load_weights(list(init_weights.items()), strict=True)
            mx.eval(self.drafter.parameters())
        self.step_fn = _Step(plan, model, self.layout, self.draft_ids)
        self.window = response_window([*self.data, *self.heldout], self.layout)
        # The step count the schedule decays over lives in an array read by the compiled step, so changing it
        # (the re-estimate after the first compiled steps) needs no new trace.
        self._schedule_total: dict[str, mx.array] = {"total": mx.array(1.0)}
        self.total_steps = 0
        self.schedule: Callable[[mx.array], mx.array] = self._lr
        self.optimizer = optim.AdamW(learning_rate=self.schedule, weight_decay=float(plan.weight_decay))
        self.grad_fn = nn.value_and_grad(self.drafter, self.step_fn.loss)
        self.rng = np.random.default_rng(int(plan.seed))
        self.step, self.epoch, self.cursor = 0, 0, 0
        self.order: list[int] = []
        self.history: list[dict[str, float]] = []
        self.tokens_seen = 0
        self.tau_history: list[tuple[int, float]] = []
        self.compiled = bool(getattr(plan, "compile", False))
        self._compiled_step: Callable[..., Any] | None = None
        self.compute_dtype = checkpoints.DTYPES[str(getattr(plan, "compute_dtype", None) or "float32")]
        if self.compute_dtype != mx.float32:
            # Frozen rows (a reduced head) are no parameters: they take the compute dtype once.
            frozen = [(k, v) for k, v in tree_flatten(self.drafter.parameters()) if k not in self._trainable_names()]
            self.drafter.load_weights([(k, v.astype(self.compute_dtype)) for k, v in frozen], strict=False)
        # τ against block tokens and training seconds, over every invocation of this run (the learning curve).
        self.curve: list[dict[str, float]] = []
        self.seconds_done = 0.0
        # The data state before the batch drawn ahead (built while the device runs the step before it): a
        # checkpoint records it, so a resumed run draws that batch again.
        self._ahead: tuple[AnchorBatch, dict[str, Any]] | None = None
        self._queued: list[_Pending] = []
        self.profile: dict[str, float] = {}

    # schedule -------------------------------------------------------------------------------------------

    @property
    def total_steps(self) -> int:
        return self._total_steps

    @total_steps.setter
    def total_steps(self, value: int) -> None:
        self._total_steps = int(value)
        self._schedule_total["total"] = mx.array(float(max(1, value)))

    def _lr(self, step: mx.array) -> mx.array:
        peak = float(self.plan.lr)
        total = self._schedule_total["total"]
        warm = mx.maximum(1.0, mx.floor(float(self.plan.warmup) * total + 0.5))
        s = step.astype(mx.float32)
        ramp = peak * (s + 1) / warm
        progress = mx.clip((s - warm) / mx.maximum(1.0, total - warm), 0.0, 1.0)
        cosine = 0.5 * peak * (1 + mx.cos(math.pi * progress))
        return mx.where(s < warm, ramp, cosine)

    # data -----------------------------------------------------------------------------------------------

    def _epoch_order(self, size: int) -> list[int]:
        """This epoch's sequence order: a permutation; with `length_grouping` G > 0, cut into groups of G
        batches, each group sorted by length and cut into batches, the batches shuffled (padding to a batch's
        longest sequence then costs little) and only whole batches kept (the rest wait for a later epoch)."""
        perm = self.rng.permutation(len(self.data))
        group = int(getattr(self.plan, "length_grouping", 0) or 0)
        if group <= 0 or len(self.data) < 2 * size:
            return [int(i) for i in perm]
        batches = []
        for lo in range(0, len(perm), size * group):
            chunk = perm[lo : lo + size * group]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches += [chunk[i : i + size] for i in range(0, len(chunk) - size + 1, size)]
        return [int(i) for j in self.rng.permutation(len(batches)) for i in batches[j]]

    def _next_batch(self) -> list[TrainSequence]:
        size = min(int(self.plan.batch), len(self.data))
        picked: list[TrainSequence] = []
        while len(picked) < size:
            if self.cursor >= len(self.order):
                if self.order:
                    self.epoch += 1
                self.order = self._epoch_order(size)
                self.cursor = 0
            take = self.order[self.cursor : self.cursor + size - len(picked)]
            self.cursor += len(take)
            picked.extend(self.data[i] for i in take)
        return picked

    def _data_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "order": self.order, "rng": self.rng.bit_generator.state}

    def _host_batch(self, seqs: Sequence[TrainSequence], rng: np.random.Generator) -> AnchorBatch:
        return anchor_batch(
            seqs,
            layout=self.layout,
            anchors=int(self.plan.anchors),
            rng=rng,
            window=self.window,
            bucket=self.compiled,
        )

    def _draw(self) -> tuple[AnchorBatch, dict[str, Any]]:
        """The next training batch and the data state before it was drawn."""
        state = self._data_state()
        return self._host_batch(self._next_batch(), self.rng), state

    def _rewind(self, ahead: tuple[AnchorBatch, dict[str, Any]]) -> None:
        """Undo drawing the batch drawn ahead (the next draw gives it again)."""
        state = ahead[1]
        self.epoch, self.cursor, self.order = state["epoch"], state["cursor"], state["order"]
        self.rng.bit_generator.state = state["rng"]

    def _arrays(self, host: AnchorBatch, step: int) -> dict[str, mx.array]:
        dev = host.arrays()
        share = float(getattr(self.plan, "own_prev", 0.0) or 0.0)
        if share > 0 and self.plan.kind == "dspark":
            dev["own"] = mx.array(_own_prev_mask(int(self.plan.seed), step, host.anchors.shape, share))
        return dev

    # steps ----------------------------------------------------------------------------------------------

    def _trainable_names(self) -> set[str]:
        return {k for k, _ in tree_flatten(self.drafter.trainable_parameters())}

    def _value_and_grad(self, extra: Mapping[str, mx.array]) -> tuple[tuple[mx.array, dict[str, mx.array]], Any]:
        """Loss and gradients; with a reduced compute dtype the float32 parameters are the master copy: the
        forward and backward run on their cast, the gradients come back in float32."""
        if self.compute_dtype == mx.float32:
            return self.grad_fn(self.drafter, extra)  # type: ignore[no-any-return]
        master = self.drafter.trainable_parameters()
        dtype = self.compute_dtype

        def cast_loss(params: Any, inputs: Mapping[str, mx.array]) -> Any:
            self.drafter.update(tree_map(lambda p: p.astype(dtype), params))
            return self.step_fn.loss(self.drafter, inputs)

        out = mx.value_and_grad(cast_loss)(master, extra)
        self.drafter.update(master)
        return out  # type: ignore[no-any-return]

    def _step_body(self, dev: Mapping[str, mx.array]) -> tuple[mx.array, dict[str, mx.array]]:
        extra = self.step_fn.inputs(dev)
        (loss, parts), grads = self._value_and_grad(extra)
        grads, norm = optim.clip_grad_norm(grads, float(self.plan.clip))
        self.optimizer.update(self.drafter, grads)
        return loss, {**parts, "grad_norm": norm}

    def _launch(self, dev: Mapping[str, mx.array]) -> tuple[mx.array, dict[str, mx.array]]:
        """Queue one training step on the device (nothing is read back)."""
        if self.compiled and self._compiled_step is None:
            # One compiled function: the target's forward, the teacher, the drafter's loss and gradient, the
            # clip and the AdamW update. The drafter's and optimizer's arrays are its state; the frozen target
            # is a constant. Shapes are bucketed (anchor_batch), so it traces a handful of times.
            state = [self.drafter.state, self.optimizer.state, self._schedule_total]
            self._compiled_step = mx.compile(self._step_body, inputs=state, outputs=state)
        step = self._compiled_step if self.compiled else self._step_body
        assert step is not None
        loss, parts = step(dict(dev))
        mx.async_eval(loss, parts, self.drafter.parameters(), self.optimizer.state)
        return loss, parts

    def _train_step(self, dev: Mapping[str, mx.array]) -> tuple[mx.array, dict[str, mx.array]]:
        loss, parts = self._launch(dev)
        mx.eval(loss, parts)
        return loss, parts

    def _collect(self, keep: int = 0) -> None:
        """Read back the queued steps' loss and accuracy, all but the last `keep` of them."""
        while len(self._queued) > keep:
            p = self._queued.pop(0)
            self.history.append({"step": p.step, "loss": float(p.loss.item()), "acc": float(p.acc.item())})

    def _calibrate_steps(self) -> int:
        """Total steps: from epochs, capped by max_steps and by the time budget (measured on 3 throwaway
        forward+backward passes with their own random generator, so the run's draws are untouched)."""
        per_epoch = max(1, math.ceil(len(self.data) / max(1, int(self.plan.batch))))
        total = max(1, round(float(self.plan.epochs) * per_epoch))
        if self.plan.max_steps:
            total = min(total, int(self.plan.max_steps))
        budget = self.plan.time_budget_s
        if budget:
            rng = np.random.default_rng(int(self.plan.seed) + 1)
            times = []
            for _ in range(3):
                seqs = [
                    self.data[int(i)]
                    for i in rng.choice(len(self.data), size=min(len(self.data), int(self.plan.batch)))
                ]
                dev = self._host_batch(seqs, rng).arrays()
                t0 = time.perf_counter()
                extra = self.step_fn.inputs(dev)
                (loss, _), grads = self.grad_fn(self.drafter, extra)
                mx.eval(loss, grads)
                times.append(time.perf_counter() - t0)
            per_step = sorted(times)[1] * 1.08  # + the optimizer update and host work
            total = min(total, max(1, int(float(budget) / per_step)))
        return total

    def _profile_steps(self, count: int) -> dict[str, float]:
        """Run the next `count` training steps one at a time (each read back before the next: no overlap) and
        time their parts: drawing the batch on the host, the whole compiled step, and (again, on the same
        batches, changing nothing) the target-side part alone: the feature forward and the teacher."""
        target_side = mx.compile(self.step_fn.inputs) if self.compiled else self.step_fn.inputs
        host_s = step_s = target_s = 0.0
        tokens = 0
        batches = []
        for _ in range(count):
            t0 = time.perf_counter()
            host, _ = self._draw()
            host_s += time.perf_counter() - t0
            dev = self._arrays(host, self.step + 1)
            t0 = time.perf_counter()
            loss, parts = self._train_step(dev)
            step_s += time.perf_counter() - t0
            self.step += 1
            self.tokens_seen += host.tokens
            tokens += host.tokens
            self._queued.append(_Pending(self.step, loss, parts["acc"]))
            batches.append(dev)
        mx.eval(target_side(batches[0]))  # the trace, outside the timing
        for dev in batches:
            t0 = time.perf_counter()
            mx.eval(target_side(dev))
            target_s += time.perf_counter() - t0
        return {
            "steps": count,
            "block_tokens_per_step": tokens / count,
            "host_ms": 1e3 * host_s / count,
            "step_ms": 1e3 * step_s / count,
            "target_ms": 1e3 * target_s / count,
            "drafter_ms": 1e3 * max(0.0, step_s - target_s) / count,
            "block_tokens_per_s": tokens / max(step_s + host_s, 1e-9),
            "steps_per_s": count / max(step_s + host_s, 1e-9),
        }

    def evaluate(self) -> tuple[float, list[float]]:
        """Teacher-forced τ (greedy, bonus included) and per-slot top-1 accuracy on the held-out set."""
        if not self.heldout:
            return 1.0, []
        rng = np.random.default_rng(EVAL_SEED)
        hits, sups = [], []
        for i in range(0, len(self.heldout), max(1, int(self.plan.batch))):
            dev = self._host_batch(self.heldout[i : i + int(self.plan.batch)], rng).arrays()
            h, s = self.step_fn.hits(self.drafter, dev)
            hits.append(h)
            sups.append(s)
        hit, sup = np.concatenate(hits), np.concatenate(sups)
        per_slot = [float(hit[:, k][sup[:, k]].mean()) if sup[:, k].any() else 0.0 for k in range(hit.shape[1])]
        return teacher_forced_tau(hit, sup), per_slot

    # state ----------------------------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        data = self._ahead[1] if self._ahead is not None else self._data_state()
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            **data,
            "history": self.history,
            "tokens_seen": self.tokens_seen,
            "tau_history": self.tau_history,
            "curve": self.curve,
            "seconds_done": self.seconds_done,
            "draft_ids": None if self.draft_ids is None else self.draft_ids.tolist(),
        }

    def _restore(self) -> bool:
        loaded = checkpoints.load_state(self.out)
        if loaded is None:
            return False
        params, opt_state, meta = loaded
        self.drafter.load_weights(list(params.items()), strict=True)
        self.optimizer.init(self.drafter.trainable_parameters())
        self.optimizer.state = tree_unflatten(list(opt_state.items()))
        self.step, self.total_steps = int(meta["step"]), int(meta["total_steps"])
        self.epoch, self.cursor, self.order = int(meta["epoch"]), int(meta["cursor"]), list(meta["order"])
        self.rng.bit_generator.state = meta["rng"]
        self.history, self.tokens_seen = list(meta["history"]), int(meta["tokens_seen"])
        self.tau_history = [tuple(x) for x in meta.get("tau_history", [])]  # type: ignore[misc]
        self.curve, self.seconds_done = list(meta.get("curve", [])), float(meta.get("seconds_done", 0.0))
        mx.eval(self.drafter.parameters(), self.optimizer.state)
        return True

    def facts(self, **more: Any) -> dict[str, Any]:
        recent = self.history[-20:]
        return {
            "kind": self.plan.kind,
            "steps": self.step,
            "total_steps": self.total_steps,
            "epochs_seen": self.epoch + (self.cursor / max(1, len(self.data))),
            "sequences": len(self.data),
            "heldout_sequences": len(self.heldout),
            "block_tokens": self.tokens_seen,
            "loss": float(np.mean([h["loss"] for h in recent])) if recent else None,
            "first_loss": self.history[0]["loss"] if self.history else None,
            "draft_vocab": None if self.draft_ids is None else len(self.draft_ids),
            "config": self.config,
            "tau_history": self.tau_history,
            "curve": self.curve,
            "continued_from": None if self.init_from is None else str(self.init_from),
            "profile": self.profile or None,
            **more,
        }

    def save(self, **more: Any) -> dict[str, Any]:
        self._collect()
        facts = self.facts(**more)
        checkpoints.write_published(
            self.out,
            self.config,
            published_weights(self.drafter, self.draft_ids),
            dtype=str(self.plan.save_dtype),
            card=self.card(facts),
        )
        checkpoints.save_state(self.out, self.drafter.parameters(), self.optimizer.state, self._meta())
        return facts

    def _point(self, tau: float, elapsed: float) -> None:
        """One point of the learning curve: held-out τ after this many block tokens and training seconds."""
        self.tau_history.append((self.step, tau))
        point = {"step": self.step, "block_tokens": self.tokens_seen, "seconds": self.seconds_done + elapsed}
        self.curve.append({**point, "tau": tau})

    # loop -----------------------------------------------------------------------------------------------

    def run(self, resume: bool) -> dict[str, Any]:
        # Freed buffers are cached up to the whole device memory by default; two runs sharing a GPU then
        # starve each other (seen on an H200), so keep the cache small.
        mx.set_cache_limit(4 << 30)
        if not (resume and self._restore()):
            self.total_steps = self._calibrate_steps()
            self.optimizer.init(self.drafter.trainable_parameters())
        every = max(1, int(self.plan.checkpoint_every))
        log_every = max(1, int(self.plan.log_every))
        eval_every = int(self.plan.eval_every or 0)
        profile_steps = int(getattr(self.plan, "profile_steps", 0) or 0)
        t_start, tokens_at_start, step_at_start = time.perf_counter(), self.tokens_seen, self.step
        interrupted = False
        budget = float(self.plan.time_budget_s or 0)
        stop_after = float(getattr(self.plan, "stop_after_s", 0) or 0)
        # A resumed run keeps the step count its first invocation settled on (one schedule across invocations).
        settled = self.step > 0
        mark: tuple[int, float] | None = None
        try:
            while self.step < self.total_steps:
                if stop_after and time.perf_counter() - t_start > stop_after:
                    raise KeyboardInterrupt  # this invocation's time is up: checkpoint, resume later
                room = self.total_steps - self.step > 2 * profile_steps
                if profile_steps and not self.profile and self.step - step_at_start >= 8 and room:
                    # After the first traces: a few steps timed part by part (they are training steps too).
                    self._collect()
                    if self._ahead is not None:
                        self._rewind(self._ahead)
                        self._ahead = None
                    self.profile = self._profile_steps(profile_steps)
                    if self.progress is not None:
                        self.progress({"step": self.step, "total": self.total_steps, "profile": self.profile})
                    continue
                host, _ = self._ahead if self._ahead is not None else self._draw()
                self._ahead = None
                loss, parts = self._launch(self._arrays(host, self.step + 1))
                self.step += 1
                self.tokens_seen += host.tokens
                self._queued.append(_Pending(self.step, loss, parts["acc"]))
                if budget and self.compiled:
                    # The count calibrated on uncompiled steps is too low for a compiled one: re-estimate once
                    # from real steps (after the traces).
                    if not settled and mark is None and self.step - step_at_start >= 10 + profile_steps:
                        self._collect()
                        mark = (self.step, time.perf_counter())
                    elif not settled and mark is not None and self.step - mark[0] >= 30:
                        self._collect()
                        per_step = (time.perf_counter() - mark[1]) / (self.step - mark[0])
                        left = budget - (time.perf_counter() - t_start)
                        self.total_steps = max(self.step + 1, self.step + int(left / (per_step * 1.03)))
                        settled = True
                    if not stop_after and time.perf_counter() - t_start > budget * 1.1:
                        self.total_steps = self.step  # out of time: finish here
                if self.step < self.total_steps:
                    self._ahead = self._draw()  # on the host while the device runs this step
                self._collect(keep=1)  # the step before this one: done, or nearly
                if eval_every and self.step % eval_every == 0 and self.step < self.total_steps:
                    self._collect()
                    self._point(self.evaluate()[0], time.perf_counter() - t_start)
                if self.step % every == 0 and self.step < self.total_steps:
                    self.save(interrupted=False, finished=False)
                if self.progress is not None and (self.step % log_every == 0 or self.step == self.total_steps):
                    self._collect()
                    elapsed = time.perf_counter() - t_start
                    done = self.step - step_at_start
                    rate = (self.tokens_seen - tokens_at_start) / max(elapsed, 1e-9)
                    eta = elapsed / max(done, 1) * (self.total_steps - self.step)
                    self.progress(
                        {
                            "step": self.step,
                            "total": self.total_steps,
                            "loss": float(np.mean([h["loss"] for h in self.history[-log_every:]])),
                            "acc": self.history[-1]["acc"],
                            "tokens_per_s": rate,
                            "steps_per_s": done / max(elapsed, 1e-9),
                            "eta_s": eta,
                            "epoch": self.epoch,
                            "tau": self.tau_history[-1][1] if self.tau_history else None,
                        }
                    )
        except KeyboardInterrupt:
            interrupted = True
        self._collect()
        elapsed = time.perf_counter() - t_start
        self.seconds_done += elapsed
        if interrupted:
            self.save(interrupted=True, finished=False)  # the checkpoint first: a second interrupt may follow
        tau, per_slot = self.evaluate()
        if not (self.curve and self.curve[-1]["step"] == self.step):
            self._point(tau, 0.0)
        facts = self.save(
            interrupted=interrupted,
            finished=self.step >= self.total_steps,
            tau_estimate=tau,
            slot_accuracy=per_slot,
            train_seconds=elapsed,
            block_tokens_per_s=(self.tokens_seen - tokens_at_start) / max(elapsed, 1e-9),
        )
        return facts
