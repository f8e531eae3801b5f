"""mlx-lm's own plain decoding (`generate_step`) as the reference ours is measured against: the same process,
the same model object and weights, the same BLAS, mlx-lm's default prefill step.

The bench (`--against mlx-lm`), the pytest-benchmark pairs and `scripts/gpu_bench.py` all time mlx-lm here.
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
