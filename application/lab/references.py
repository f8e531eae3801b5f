"""What `bench --against` measures ours against besides mlx-lm's plain decoding: mlx-lm's draft-model
speculation (`mlx-lm-draft`) with the draft model our own `--mode draft` pairs with a target
(`application.draft_models`, which also checks that the two share one vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_dspark.application.draft_models import check_shared_vocabulary, draft_model_name
from mlx_dspark.application.ports import LoadedModel, ModelLoader
from mlx_dspark.domain.errors import InvalidRequest

__all__ = ["DRAFT_REFERENCE", "check_shared_vocabulary", "draft_model_name", "load_draft_model", "reference_kinds"]

REFERENCE_KINDS = ("mlx-lm", "mlx-lm-draft")
DRAFT_REFERENCE = "mlx-lm-draft"
DEFAULT_NUM_DRAFT = (2, 4, 8)


def load_draft_model(loader: ModelLoader, target: LoadedModel, given: str | None) -> LoadedModel:
    """The draft model for `target` (given or its default), loaded and checked against the target's vocabulary."""
    draft = loader.load_target(draft_model_name(target.name, given, needed_by=f"--against {DRAFT_REFERENCE}"))
    check_shared_vocabulary(target, draft)
    return draft


def reference_kinds(spec: str) -> list[str]:
    """`--against mlx-lm,mlx-lm-draft` → the reference kinds in order, each once.

    Raises:
        InvalidRequest: an unknown kind or none.
    """
    kinds = list(dict.fromkeys(k.strip() for k in spec.split(",") if k.strip()))
    bad = [k for k in kinds if k not in REFERENCE_KINDS]
    if bad or not kinds:
        raise InvalidRequest(
            message=f"--against takes {' or '.join(REFERENCE_KINDS)} (comma-separated); got {spec!r}", param="against"
        )
    return kinds


def num_draft_values(spec: str | Sequence[int] | None) -> list[int]:
    """`--num-draft 2,4,8` → sorted distinct positive counts (None: DEFAULT_NUM_DRAFT).

    Raises:
        InvalidRequest: not positive integers.
    """
    if spec is None:
        return list(DEFAULT_NUM_DRAFT)
    try:
        values = sorted({int(x) for x in (spec.split(",") if isinstance(spec, str) else spec) if str(x).strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise InvalidRequest(message=f"--num-draft takes positive integers like 2,4,8; got {spec!r}", param="num_draft")
    return values
