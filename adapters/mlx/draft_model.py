"""A small model of the target's vocabulary as a draft source (`--mode draft --draft-model NAME|DIR`).

It drafts one token at a time from its own cache, which follows the target's committed tokens. Each round: the
rows that its last block and the committed history share are kept and the rest trimmed (exact for KV caches; a
cache that cannot trim, recurrent or convolutional layers or a wrapped window, is rebuilt from the history), the
newly committed tokens up to the anchor are fed, and `cap` one-token steps are chained on the device (the last
draft is not fed: nothing reads its logits). Greedy drafts are the argmax, with a one-hot q; sampled drafts are
drawn from the draft model's own distribution, truncated as the target's sampling truncates, and that distribution
is their q, so the target's rejection sampling stays exact. Without a confidence threshold nothing is read back
here: the verify reads the tokens with its verdict, and the next round learns them from the committed history.
With one, the block ends after the first draft the draft model gave less than it (its probability is read each
step): the next draft would rarely survive, and on a CPU a draft step costs a third of the target's. The stop
depends only on drafts already drawn, so the sampled law stays exact.

Where plain steps run compiled (`compiled_forward.steps_enabled`: the CPU), so do its one-token steps: with a
confidence threshold each step is read before the next is built, so the graph building is all exposed there.

The draft model must score exactly the target's token ids (the application checks it): MLX's embedding lookup
does not check bounds, so a draft id past the target's vocabulary would read memory past the table into the
target's cache.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any, Self, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from mlx_dspark.adapters.mlx import compiled_forward, cpu_kernels, model_parts
from mlx_dspark.adapters.mlx.compiled_forward import CompiledForward
from mlx_dspark.adapters.mlx.drafters.heads import DraftVocabulary
from mlx_dspark.adapters.mlx.drafters.source import PROPOSALS, pick
from mlx_dspark.adapters.mlx.readback import DeviceTokens
from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.tokens import SamplingParams

MAX_BLOCK = 16  # drafts one round may ask for; the cap policy picks fewer from the measured curves
# The block ends after a draft its model gave less than this (the loader's default; the source alone stops never).
# Qwen2.5-Coder 0.5B drafting for the 1.5B on the CPU: with OpenBLAS's GEMM, cap 8, 0.4 took prose 1.28 → 2.11
# tok/s (code unchanged); with the few-row BLAS kernel, measured caps, 6 held-out prompts, 0.2 ran 4.92 tok/s
# (3.03 tokens a round) where 0.4 ran 4.09 on 3 of them: 1.19x mlx-lm's best draft speculation against 1.05x.
DEFAULT_STOP = 0.2
PREFILL_CHUNK = 512  # history tokens per forward while catching up (bounds activation memory)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelSource(DraftVocabulary):
    """DraftSource over an mlx-lm model sharing the target's vocabulary (checked by the application).

    Args:
        model: the draft model's mlx-lm module.
        identity: the draft model's own identity (its calibrated cost curves are stored under it).
        proposal: "sample" (sampled requests draw from q) or "argmax" (always the argmax, one-hot q).
        confidence_threshold: in [0, 1); > 0 ends a block after a draft the draft model gave less than it
            (0: every block runs to its cap; the loader passes DEFAULT_STOP unless told otherwise).
        vocab_ids: draft only these token ids (a draft vocabulary: the tokens text uses most): the head reads
            these rows alone, and q is the draft model's distribution over them (zero elsewhere), which is the
            law the drafts are drawn from, so rejection sampling stays exact. None: the whole vocabulary. Not
            applied to a model whose forward is more than its decoder and head (checked once here).
    """

    def __init__(
        self,
        model: Any,
        *,
        identity: str = "",
        proposal: str = "sample",
        confidence_threshold: float = 0.0,
        vocab_ids: Sequence[int] | None = None,
    ) -> None:
        if proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
        if not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        self.model = model
        self.vocab_size = model_parts.vocab_size(model)
        self._head = self._reduced_head(vocab_ids)
        stop = f":stop={confidence_threshold:g}" if confidence_threshold > 0 else ""
        vocab = f":vocab={self.draft_vocab_size}" if self._head is not None else ""
        self.identity = f"draft:{identity or type(model).__module__}:block={MAX_BLOCK}{stop}{vocab}"
        self.proposal = proposal
        self.confidence_threshold = confidence_threshold
        self._cache: list[Any] | None = None
        self._ids: list[int] = []  # the tokens whose rows the cache holds, in order
        self._fed: DeviceTokens | None = None  # the last block's drafts that were fed (their ids not read yet)
        # One-token steps as one compiled graph (shared by forks: the same weights), where plain steps compile.
        self._compiled = (
            CompiledForward(self._logits, lambda _layers: None) if compiled_forward.steps_enabled() else None
        )

    @property
    def name(self) -> str:
        return "draft"

    @property
    def draft_vocab_size(self) -> int:
        """Tokens it can draft: the draft vocabulary's, else the whole vocabulary."""
        return self.vocab_size if self._draft_to_target is None else int(self._draft_to_target.shape[0])

    @property
    def max_block(self) -> int:
        return MAX_BLOCK

    @property
    def uses_features(self) -> bool:
        return False

    @property
    def cached_ids(self) -> tuple[int, ...]:
        """The tokens the draft model's cache holds rows for (the last block's drafts once known)."""
        self._settle()
        return tuple(self._ids)

    def begin(self, prompt: Sequence[int]) -> None:
        self._cache, self._ids, self._fed = None, [], None

    def fork(self) -> Self:
        """The same weights with a cache of its own: one per batched request."""
        twin = copy.copy(self)
        twin.begin(())
        return twin

    def without_stop(self) -> Self:
        """A fork whose blocks always run to the cap (calibration times `cap` drafts with it)."""
        twin = self.fork()
        twin.confidence_threshold = 0.0
        return twin

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]) -> DraftBlock:
        """Up to `cap` drafts after ctx.anchor, each from the draft model's step over the one before it."""
        n = max(0, min(cap, MAX_BLOCK))
        if n == 0:  # nothing to draft: catching up can wait for a round that drafts
            return DraftBlock(source=self.name)
        logits = self._catch_up(ctx.history)
        sampled = not sampling.greedy and self.proposal == "sample"
        u = mx.array(list(uniforms[:n]), dtype=mx.float32) if sampled else None
        tokens: list[mx.array] = []
        qs: list[mx.array] = []
        for i in range(n):
            index, q = pick(logits, sampling, None if u is None else u[i])  # over the draft vocabulary
            token = self.to_target_ids(index)
            tokens.append(token)
            if q is not None:
                qs.append(self.to_target_probs(q))
            if i + 1 == n or self._unsure(logits, index, q):
                break
            logits = self._step(token.reshape(1, 1))
        drafts = mx.stack(tokens).astype(mx.int32)
        q_rows = mx.stack(qs) if qs else None
        self._fed = DeviceTokens(drafts[: len(tokens) - 1])
        mx.async_eval(drafts, *([] if q_rows is None else [q_rows]), *self._state())
        return DraftBlock(pending=DeviceTokens(drafts), q=q_rows, source=self.name)

    # Internals -----------------------------------------------------------------------------------

    def _unsure(self, logits: mx.array, token: mx.array, q: mx.array | None) -> bool:
        """Whether the draft model gave `token` less than the threshold: then the block ends with it. (Its
        next draft would rarely survive, and a draft step costs a good share of a target step.) Reading the
        probability waits for this step; without a threshold nothing is read."""
        if self.confidence_threshold <= 0:
            return False
        p = q[token] if q is not None else mx.softmax(logits.astype(mx.float32))[token]
        return float(p.item()) < self.confidence_threshold

    def _settle(self) -> None:
        """Add the last block's fed drafts to the cached ids (the verify has read them by now)."""
        if self._fed is not None:
            self._ids.extend(self._fed.read())
            self._fed = None

    def _catch_up(self, history: Sequence[int]) -> mx.array:
        """Trim the cache to what it shares with `history`, feed the rest; the logits [V] after the anchor."""
        self._settle()
        keep = min(shared_prefix(self._ids, history), len(history) - 1)  # the anchor always runs: it drafts d1
        if self._cache is None or (keep < len(self._ids) and not can_trim_prompt_cache(self._cache)):
            self._cache, self._ids, keep = make_prompt_cache(self.model), [], 0
        if keep < len(self._ids):
            trim_prompt_cache(self._cache, len(self._ids) - keep)
            del self._ids[keep:]
        rest = list(history[keep:])
        logits = None
        with cpu_kernels.active():  # a long history catches up in wide chunks
            for start in range(0, len(rest), PREFILL_CHUNK):
                chunk = rest[start : start + PREFILL_CHUNK]
                logits = self._step(mx.array([chunk], dtype=mx.int32))
                if start + PREFILL_CHUNK < len(rest):
                    mx.eval(*self._state())
        self._ids.extend(rest)
        assert logits is not None
        return logits

    def _state(self) -> list[mx.array]:
        return [a for _, a in tree_flatten([c.state for c in self._cache or ()]) if isinstance(a, mx.array)]

    def _step(self, tokens: mx.array) -> mx.array:
        """The logits over the draft vocabulary after feeding `tokens` [1, n] into the cache (the head runs on
        the last row only where the vocabulary is reduced)."""
        compiled = self._compiled
        if compiled is not None and tokens.shape[1] == 1 and self._cache and compiled.applies(self._cache, 1):
            try:
                return compiled(tokens.reshape(-1), self._cache, ())[0][0, -1]
            except Exception as exc:  # a model MLX cannot trace: eager steps from now on
                warnings.warn(f"compiled draft steps off for this model: {exc!r}", RuntimeWarning, stacklevel=2)
                self._compiled = None
        return self._logits(tokens, cache=self._cache)[0, -1]

    def _logits(self, tokens: mx.array, cache: Any) -> mx.array:
        """Logits of `tokens` [1, n] after `cache`'s rows: [1, n, V], or with the reduced head [1, 1, V_draft] of
        the last row alone."""
        if self._head is None:
            return cast(mx.array, self.model(tokens, cache=cache))
        return cast(mx.array, self._head(model_parts.final_hidden(self.model, tokens, cache)[:, -1:]))

    def _reduced_head(self, vocab_ids: Sequence[int] | None) -> Any:
        """The head over `vocab_ids` (setting the draft → target id map), or None (the whole vocabulary): no ids,
        all of them, a head layout `head_subset` does not know, or a forward that is not decoder + head (its
        logits on a probe differ from the model's own)."""
        self.map_draft_vocabulary(None)
        wanted = sorted({int(i) for i in vocab_ids or () if 0 <= int(i) < self.vocab_size})
        if not wanted or len(wanted) >= self.vocab_size:
            return None
        ids = mx.array(wanted, dtype=mx.int32)
        head = model_parts.head_subset(self.model, ids)
        if head is None:
            return None
        probe = ids[:4].reshape(1, -1)
        full = self.model(probe)[0, -1].astype(mx.float32)[ids]
        try:
            mine = head(model_parts.final_hidden(self.model, probe, None)[0, -1]).astype(mx.float32)
        except (TypeError, ValueError):  # a decoder that needs more than tokens and a cache
            return None
        bound = 1e-2 * float(mx.max(mx.abs(full)).item()) + 1e-3  # a structure check, not a rounding one
        if float(mx.max(mx.abs(full - mine)).item()) > bound:
            return None
        self.map_draft_vocabulary(ids - mx.arange(len(wanted), dtype=mx.int32))
        return head
