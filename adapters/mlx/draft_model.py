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

The draft model must score exactly the target's token ids (the application checks it): MLX's embedding lookup
does not check bounds, so a draft id past the target's vocabulary would read memory past the table into the
target's cache.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Self

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from mlx_dspark.adapters.mlx import cpu_kernels
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


class DraftModelSource:
    """DraftSource over an mlx-lm model sharing the target's vocabulary (checked by the application).

    Args:
        model: the draft model's mlx-lm module.
        identity: the draft model's own identity (its calibrated cost curves are stored under it).
        proposal: "sample" (sampled requests draw from q) or "argmax" (always the argmax, one-hot q).
        confidence_threshold: in [0, 1); > 0 ends a block after a draft the draft model gave less than it
            (0: every block runs to its cap; the loader passes DEFAULT_STOP unless told otherwise).
    """

    def __init__(
        self, model: Any, *, identity: str = "", proposal: str = "sample", confidence_threshold: float = 0.0
    ) -> None:
        if proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
        if not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        self.model = model
        stop = f":stop={confidence_threshold:g}" if confidence_threshold > 0 else ""
        self.identity = f"draft:{identity or type(model).__module__}:block={MAX_BLOCK}{stop}"
        self.proposal = proposal
        self.confidence_threshold = confidence_threshold
        self._cache: list[Any] | None = None
        self._ids: list[int] = []  # the tokens whose rows the cache holds, in order
        self._fed: DeviceTokens | None = None  # the last block's drafts that were fed (their ids not read yet)

    @property
    def name(self) -> str:
        return "draft"

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
            token, q = pick(logits, sampling, None if u is None else u[i])
            tokens.append(token)
            if q is not None:
                qs.append(q)
            if i + 1 == n or self._unsure(logits, token, q):
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
        """The logits [V] after feeding `tokens` [1, n] into the cache."""
        return self.model(tokens, cache=self._cache)[0, -1]
