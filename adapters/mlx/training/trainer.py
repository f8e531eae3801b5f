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
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dspark.adapters.mlx import model_parts
from mlx_dspark.adapters.mlx.drafters.config import parse_dflash, parse_dspark
from mlx_dspark.adapters.mlx.drafters.dflash import DFlashDrafter
from mlx_dspark.adapters.mlx.drafters.dspark import DSparkDrafter
from mlx_dspark.adapters.mlx.drafters.heads import target_embedding, target_head
from mlx_dspark.adapters.mlx.training import checkpoints
from mlx_dspark.adapters.mlx.training.features import capture, head_rows
from mlx_dspark.adapters.mlx.training.generate import generate_responses
from mlx_dspark.adapters.mlx.training.recipe import (
    IGNORE,
    BlockLayout,
    TrainSequence,
    build_batch,
    dflash_loss,
    dspark_loss,
    teacher_forced_tau,
    to_device,
)

Progress = Callable[[Mapping[str, Any]], None]
EVAL_SEED = 1234  # held-out anchors are the same at every evaluation
BUCKET = 64  # context lengths of a compiled step are padded to a multiple of this


def drafter_config(plan: Any, model: nn.Module) -> dict[str, Any]:
    """The published `config.json` of a new drafter for `model` (z-lab DFlash or DeepSpec DSpark layout).

    Layer shapes are the target's (the drafter shares its width, embedding and head), as in the published
    drafters; `num_hidden_layers`, `block_size` and the target layers come from the plan.
    """
    args = model_parts.model_args(model)
    hidden = model_parts.hidden_size(model)
    heads = int(args.num_attention_heads)
    common = {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": int(args.intermediate_size),
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
    drafter.norm.weight = model_parts._decoder(model).norm.weight.astype(mx.float32)
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
    new data continues the same drafter.
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
    plan = attrs.evolve(
        plan,
        layers=int(raw["num_hidden_layers"]),
        block_size=int(raw["block_size"]),
        target_layers=tuple(dcfg.get("target_layer_ids") or raw["target_layer_ids"]),
        mask_token_id=int(dcfg.get("mask_token_id", raw.get("mask_token_id", 0))),
        markov_rank=int(raw.get("markov_rank", plan.markov_rank)),
        draft_vocab=0 if draft_ids is None else len(draft_ids),
    )
    weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in loaded.items()}
    return plan, draft_ids, weights


class _Step:
    """One kind's loss over a device batch, and the teacher-forced evaluation of held-out blocks."""

    def __init__(self, plan: Any, model: nn.Module, layout: BlockLayout, draft_ids: np.ndarray | None) -> None:
        self.kind = plan.kind
        self.model = model
        self.layout = layout
        self.layer_ids = tuple(plan.target_layers)
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

    def inputs(self, dev: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """Frozen-target inputs of the loss: features, and for DSpark the teacher distribution."""
        feats, final = capture(self.model, dev["ctx_ids"], self.layer_ids, final=self.kind == "dspark")
        out = {"feats": feats}
        if final is not None:
            b = final.shape[0]
            rows = dev["target_rows"].reshape(b, -1)
            hidden = mx.take_along_axis(final, rows[..., None], axis=1)
            probs = mx.softmax(model_parts.lm_head(self.model, hidden).astype(mx.float32), axis=-1)
            probs = probs.reshape(*dev["target_rows"].shape, -1)
            teacher = probs if self.draft_ids is None else mx.take(probs, self.draft_ids, axis=-1)
            out["teacher"] = mx.stop_gradient(teacher)
            out["outside"] = mx.stop_gradient(mx.maximum(1.0 - teacher.sum(axis=-1), 0.0))
            labels = dev["labels"]
            out["labels_draft"] = mx.where(labels != IGNORE, self.t2d[mx.maximum(labels, 0)], IGNORE)
        return out

    def slot_logits(self, drafter: nn.Module, dev: Mapping[str, mx.array], feats: mx.array) -> tuple[mx.array, Any]:
        """Logits [B, N, slots, V] of the supervised slots (DSpark: Markov-corrected) and the hidden rows."""
        ctx = drafter.context_kv(drafter.fuse(feats), 0)
        h = drafter.hidden(drafter.embed_block(dev["block_ids"]), dev["positions"], context=ctx, masks=dev["mask"])
        b, q, width = h.shape
        bs = self.layout.block_size
        h = h.reshape(b, q // bs, bs, width)[:, :, self.layout.first_slot :, :]
        if self.kind == "dflash":
            return drafter.logits(h), (h, None)
        prev = drafter.prev_embedding(dev["prev_ids"])
        return drafter.corrected(drafter.base_logits(h), prev), (h, prev)

    def loss(self, drafter: nn.Module, dev: Mapping[str, mx.array], extra: Mapping[str, mx.array]) -> Any:
        logits, (h, prev) = self.slot_logits(drafter, dev, extra["feats"])
        if self.kind == "dflash":
            return dflash_loss(logits, self._draft_labels(dev["labels"]), self.layout)
        conf = drafter.confidence_logit(h, prev)
        return dspark_loss(
            logits, conf, extra["labels_draft"], dev["labels"], extra["teacher"], extra["outside"], self.layout
        )

    def hits(self, drafter: nn.Module, dev: Mapping[str, mx.array]) -> tuple[np.ndarray, np.ndarray]:
        """Per held-out block and slot: argmax == label (greedy, teacher-forced), and whether supervised."""
        extra = self.inputs(dev)
        logits, _ = self.slot_logits(drafter, dev, extra["feats"])
        labels = extra.get("labels_draft", self._draft_labels(dev["labels"]))
        guess = mx.argmax(logits, axis=-1)
        hit = np.array(guess == labels)
        sup = np.array(dev["labels"] != IGNORE)
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
            "embedding_rows": int(model_parts._decoder(model).embed_tokens.weight.shape[0]),
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
        vocab = model_parts.vocab_size(model)
        self.draft_ids = None
        self.init_from = committed_start(plan, out, resume)
        init_weights: dict[str, mx.array] | None = None
        if self.init_from is not None:
            plan, self.draft_ids, init_weights = _committed(plan, self.init_from)
            self.plan = plan
        elif plan.draft_vocab and plan.draft_vocab < vocab:
            self.draft_ids = draft_vocabulary(self.data, int(plan.draft_vocab), vocab, plan.always_draft)
        self.layout = BlockLayout.for_kind(plan.kind, int(plan.block_size))
        self.drafter, self.config = build_drafter(plan, model, self.draft_ids)
        if init_weights is not None:
            if self.draft_ids is not None and "lm_head.weight" not in init_weights:
                init_weights["lm_head.weight"] = self.drafter.lm_head.weight
            self.drafter.load_weights(list(init_weights.items()), strict=True)
            mx.eval(self.drafter.parameters())
        self.step_fn = _Step(plan, model, self.layout, self.draft_ids)
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

    # schedule -------------------------------------------------------------------------------------------

    def _lr(self, step: mx.array) -> mx.array:
        peak = float(self.plan.lr)
        total = max(1, self.total_steps)
        warm = max(1, round(float(self.plan.warmup) * total))
        s = step.astype(mx.float32)
        ramp = peak * (s + 1) / warm
        progress = mx.clip((s - warm) / max(1, total - warm), 0.0, 1.0)
        cosine = 0.5 * peak * (1 + mx.cos(math.pi * progress))
        return mx.where(s < warm, ramp, cosine)

    # data -----------------------------------------------------------------------------------------------

    def _next_batch(self) -> list[TrainSequence]:
        size = min(int(self.plan.batch), len(self.data))
        picked: list[TrainSequence] = []
        while len(picked) < size:
            if self.cursor >= len(self.order):
                if self.order:
                    self.epoch += 1
                self.order = [int(i) for i in self.rng.permutation(len(self.data))]
                self.cursor = 0
            take = self.order[self.cursor : self.cursor + size - len(picked)]
            self.cursor += len(take)
            picked.extend(self.data[i] for i in take)
        return picked

    def _device_batch(self, seqs: Sequence[TrainSequence], rng: np.random.Generator) -> tuple[dict[str, mx.array], int]:
        host = build_batch(
            seqs,
            layout=self.layout,
            anchors=int(self.plan.anchors),
            mask_token_id=int(self.plan.mask_token_id),
            rng=rng,
            bucket=BUCKET if self.compiled else 0,
        )
        return to_device(host), host.tokens

    # steps ----------------------------------------------------------------------------------------------

    def _step_body(self, dev: Mapping[str, mx.array]) -> tuple[mx.array, dict[str, mx.array]]:
        extra = self.step_fn.inputs(dev)
        (loss, parts), grads = self.grad_fn(self.drafter, dev, extra)
        grads, norm = optim.clip_grad_norm(grads, float(self.plan.clip))
        self.optimizer.update(self.drafter, grads)
        return loss, {**parts, "grad_norm": norm}

    def _train_step(self, dev: Mapping[str, mx.array]) -> tuple[mx.array, dict[str, mx.array]]:
        if self.compiled and self._compiled_step is None:
            # The drafter's and optimizer's arrays are the compiled function's state; the frozen target is
            # a constant. Shapes are bucketed (build_batch), so it traces a handful of times.
            state = [self.drafter.state, self.optimizer.state]
            self._compiled_step = mx.compile(self._step_body, inputs=state, outputs=state)
        step = self._compiled_step if self.compiled else self._step_body
        assert step is not None
        loss, parts = step(dict(dev))
        mx.eval(loss, parts, self.drafter.parameters(), self.optimizer.state)
        return loss, parts

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
                dev, _ = self._device_batch(seqs, rng)
                t0 = time.perf_counter()
                extra = self.step_fn.inputs(dev)
                (loss, _), grads = self.grad_fn(self.drafter, dev, extra)
                mx.eval(loss, grads)
                times.append(time.perf_counter() - t0)
            per_step = sorted(times)[1] * 1.08  # + the optimizer update and host work
            total = min(total, max(1, int(float(budget) / per_step)))
        return total

    def evaluate(self) -> tuple[float, list[float]]:
        """Teacher-forced τ (greedy, bonus included) and per-slot top-1 accuracy on the held-out set."""
        if not self.heldout:
            return 1.0, []
        rng = np.random.default_rng(EVAL_SEED)
        hits, sups = [], []
        for i in range(0, len(self.heldout), max(1, int(self.plan.batch))):
            dev, _ = self._device_batch(self.heldout[i : i + int(self.plan.batch)], rng)
            h, s = self.step_fn.hits(self.drafter, dev)
            hits.append(h)
            sups.append(s)
        hit, sup = np.concatenate(hits), np.concatenate(sups)
        per_slot = [float(hit[:, k][sup[:, k]].mean()) if sup[:, k].any() else 0.0 for k in range(hit.shape[1])]
        return teacher_forced_tau(hit, sup), per_slot

    # state ----------------------------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "order": self.order,
            "rng": self.rng.bit_generator.state,
            "history": self.history,
            "tokens_seen": self.tokens_seen,
            "tau_history": self.tau_history,
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
            "continued_from": None if self.init_from is None else str(self.init_from),
            **more,
        }

    def save(self, **more: Any) -> dict[str, Any]:
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
        t_start, tokens_at_start, step_at_start = time.perf_counter(), self.tokens_seen, self.step
        interrupted = False
        budget = float(self.plan.time_budget_s or 0)
        mark: tuple[int, float] | None = None
        try:
            while self.step < self.total_steps:
                dev, tokens = self._device_batch(self._next_batch(), self.rng)
                loss, parts = self._train_step(dev)
                self.step += 1
                self.tokens_seen += tokens
                if budget and self.compiled:
                    # The count calibrated on uncompiled steps is too low for a compiled one: re-estimate once
                    # from real steps (after the traces), and retrace so the schedule sees the new count.
                    done_here = self.step - step_at_start
                    if done_here == 10:
                        mark = (self.step, time.perf_counter())
                    elif mark is not None and done_here == 40:
                        per_step = (time.perf_counter() - mark[1]) / (self.step - mark[0])
                        left = budget - (time.perf_counter() - t_start)
                        self.total_steps = max(self.step + 1, self.step + int(left / (per_step * 1.03)))
                        self._compiled_step = None
                    if time.perf_counter() - t_start > budget * 1.1:
                        self.total_steps = self.step  # out of time: finish here
                self.history.append({"step": self.step, "loss": float(loss.item()), "acc": float(parts["acc"].item())})
                if eval_every and self.step % eval_every == 0 and self.step < self.total_steps:
                    self.tau_history.append((self.step, self.evaluate()[0]))
                if self.step % every == 0 and self.step < self.total_steps:
                    self.save(interrupted=False, finished=False)
                if self.progress is not None and (self.step % log_every == 0 or self.step == self.total_steps):
                    elapsed = time.perf_counter() - t_start
                    done = self.step - step_at_start
                    rate = (self.tokens_seen - tokens_at_start) / max(elapsed, 1e-9)
                    eta = elapsed / max(done, 1) * (self.total_steps - self.step)
                    self.progress(
                        {
                            "step": self.step,
                            "total": self.total_steps,
                            "loss": float(np.mean([h["loss"] for h in self.history[-log_every:]])),
                            "acc": float(parts["acc"].item()),
                            "tokens_per_s": rate,
                            "eta_s": eta,
                            "epoch": self.epoch,
                            "tau": self.tau_history[-1][1] if self.tau_history else None,
                        }
                    )
        except KeyboardInterrupt:
            interrupted = True
        tau, per_slot = self.evaluate()
        self.tau_history.append((self.step, tau))
        facts = self.save(
            interrupted=interrupted,
            finished=self.step >= self.total_steps,
            tau_estimate=tau,
            slot_accuracy=per_slot,
            train_seconds=time.perf_counter() - t_start,
        )
        return facts
