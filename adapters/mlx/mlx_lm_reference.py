"""mlx-lm's own decoding as the reference ours is measured against: the same process, the same model object
and weights, the same BLAS, mlx-lm's default prefill step. Plain greedy decoding (`generate_step`) and
mlx-lm's draft-model speculation (`speculative_generate_step`, greedy, a second model drafting).

The bench (`--against mlx-lm`, `--against mlx-lm-draft`), the pytest-benchmark pairs and `scripts/gpu_bench.py`
all time mlx-lm here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mlx_dspark.domain.model import LoadedModel, ReferenceRun
from mlx_dspark.domain.ports import Clock


class _PerfCounter:
    def now(self) -> float:
        return time.perf_counter()


def reference_generate(
    handle: Any,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
    clock: Clock | None = None,
) -> ReferenceRun:
    """Greedy decoding of `prompt` by mlx-lm's `generate_step` on the mlx-lm module `handle`.

    Its own fresh cache; the first EOS ends the run and is not included (as the decode loop does).
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    now = (clock or _PerfCounter()).now
    out: list[int] = []
    start = now()
    first_at: float | None = None
    steps = generate_step(mx.array(list(prompt)), handle, max_tokens=max_tokens)
    try:
        for token, _ in steps:
            tok = int(token)
            if first_at is None:
                first_at = now()
            if tok in eos_ids:
                break
            out.append(tok)
    finally:
        steps.close()  # drops the step mlx-lm queued ahead
    end = now()
    first_at = end if first_at is None else first_at
    return ReferenceRun(token_ids=tuple(out), prefill_s=first_at - start, decode_s=end - first_at)


class MlxLmReference:
    """The `ReferenceDecoder` port over mlx-lm (the loaded model's handle is an mlx-lm module)."""

    name = "mlx-lm"

    def generate(
        self, model: LoadedModel, prompt: Sequence[int], *, max_tokens: int, eos_ids: frozenset[int], clock: Clock
    ) -> ReferenceRun:
        if model.handle is None:
            raise TypeError(f"{model.name} has no mlx-lm module to decode with")
        return reference_generate(model.handle, prompt, max_tokens=max_tokens, eos_ids=eos_ids, clock=clock)


def reference_speculative_generate(
    handle: Any,
    draft: Any,
    prompt: Sequence[int],
    *,
    num_draft: int,
    max_tokens: int,
    eos_ids: frozenset[int] = frozenset(),
    clock: Clock | None = None,
) -> ReferenceRun:
    """Greedy decoding of `prompt` by mlx-lm's `speculative_generate_step`: the mlx-lm module `draft` proposes
    `num_draft` tokens a round, `handle` verifies them.

    Fresh caches of its own for both; the first EOS ends the run and is not included. mlx-lm has no separate
    prefill token: its first token comes out of the first round, so `prefill_s` includes one round.
    `rounds` counts the verify rounds run (each ends with the target's own token, unless the budget cut it).
    """
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    now = (clock or _PerfCounter()).now
    out: list[int] = []
    rounds = 0
    new_round = True
    start = now()
    first_at: float | None = None
    steps = speculative_generate_step(
        mx.array(list(prompt)), handle, draft, num_draft_tokens=num_draft, max_tokens=max_tokens
    )
    try:
        for token, _, from_draft in steps:
            tok = int(token)
            if first_at is None:
                first_at = now()
            if new_round:
                rounds += 1
            new_round = not from_draft  # the target's own token closes a round
            if tok in eos_ids:
                break
            out.append(tok)
    finally:
        steps.close()
    end = now()
    first_at = end if first_at is None else first_at
    return ReferenceRun(token_ids=tuple(out), prefill_s=first_at - start, decode_s=end - first_at, rounds=rounds)


class MlxLmDraftReference:
    """The `ReferenceDecoder` port over mlx-lm's draft-model speculation: `draft` (a loaded model sharing the
    target's vocabulary; the caller checks that) proposes `num_draft` tokens a round. Named `mlx-lm-draft@N`."""

    def __init__(self, draft: LoadedModel, num_draft: int) -> None:
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {num_draft}")
        if draft.handle is None:
            raise TypeError(f"draft model {draft.name} has no mlx-lm module")
        self.draft = draft
        self.num_draft = num_draft
        self.name = f"mlx-lm-draft@{num_draft}"

    def generate(
        self, model: LoadedModel, prompt: Sequence[int], *, max_tokens: int, eos_ids: frozenset[int], clock: Clock
    ) -> ReferenceRun:
        if model.handle is None:
            raise TypeError(f"{model.name} has no mlx-lm module to decode with")
        return reference_speculative_generate(
            model.handle,
            self.draft.handle,
            prompt,
            num_draft=self.num_draft,
            max_tokens=max_tokens,
            eos_ids=eos_ids,
            clock=clock,
        )
