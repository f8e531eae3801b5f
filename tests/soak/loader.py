"""The ModelLoader port over a tiny real MLX model: the server runs the real target, batch scheduler and drafters.

A random mlx-lm Qwen3 (hidden 64, six layers) whose vocabulary is the FakeTokenizer's (one id per character, a
real ChatML template), its residual writes damped so the next token depends mostly on the last one: drafters
built from its bigram table (DSpark) and n-gram lookup get many drafts right, not all. Every mode batches,
since `bootstrap.batch_backend_factory` batches any MlxTargetModel with plain KV caches.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.errors import ModelUnavailable
from mlx_dspark.domain.ports import DraftSource
from tests.fakes.tokenizer import FakeTokenizer
from tests.integration.drafters import helpers

NAME = "tiny"
WINDOW = 512  # small, so a long prompt is a real share of it and a longer one does not fit
PREFILL_CHUNK = 64  # a 400-token prompt is prefilled in 7 chunks, between the other rows' steps
DRAFT_BLOCK = 4


@functools.cache
def _module(seed: int) -> Any:
    return helpers.tiny_target("qwen3", seed=seed, vocab=FakeTokenizer().vocab_size)


@functools.cache
def _drafter_dir(kind: str, seed: int) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"soak-{kind}-")) / "d"
    if kind == "dflash":
        return helpers.write_dflash(root, variant="v2", vocab=FakeTokenizer().vocab_size)
    return helpers.write_dspark(root, _module(seed), block_size=DRAFT_BLOCK)


class TinyMlxLoader:
    """Serves one tiny MLX model (`tiny`) with real DSpark and DFlash drafters and lookup drafts.

    Attributes:
        loads: how many times the target was asked for (a reload after repeated engine failures asks again).
    """

    def __init__(self, *, seed: int = 2, context_window: int = WINDOW) -> None:
        self.seed = seed
        self.tokenizer = FakeTokenizer()
        self.context_window = context_window
        self.loads = 0

    def load_target(self, name: str) -> LoadedModel:
        if name not in (NAME, "default"):
            raise ModelUnavailable(message=f"model {name!r} is not the tiny soak model")
        self.loads += 1
        module = _module(self.seed)
        return LoadedModel(
            name=NAME,
            identity=f"soak-tiny-qwen3-{self.seed}",
            target=MlxTargetModel(module, prefill_chunk=PREFILL_CHUNK),
            tokenizer=self.tokenizer,
            context_window=self.context_window,
            family="qwen3",
            handle=module,
        )

    def load_drafter(self, kind: str, spec: str | None, model: LoadedModel, *, bits: int | None) -> DraftSource:
        if kind == "lookup":
            return LookupDraftSource(block=DRAFT_BLOCK, min_n=1, max_n=3)
        if kind not in ("dspark", "dflash"):
            raise ModelUnavailable(message=f"no {kind} drafter for the tiny soak model")
        path = spec or str(_drafter_dir(kind, self.seed))
        return load_drafter(kind, path, model.handle, target=model.target, bits=bits or 0)

    def available_drafters(self, model: LoadedModel) -> Sequence[str]:
        return ["lookup", "dspark", "dflash"]

    def drafter_kind(self, spec: str) -> str | None:
        return None
