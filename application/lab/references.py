"""What `bench --against` measures ours against besides mlx-lm's plain decoding: the draft model mlx-lm's
draft-model speculation (`mlx-lm-draft`) uses for a target, and the check that target and draft share one
vocabulary (speculation compares token ids, so two tokenizers that disagree would compare nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_dspark.application.ports import LoadedModel, ModelLoader
from mlx_dspark.domain.errors import InvalidRequest

REFERENCE_KINDS = ("mlx-lm", "mlx-lm-draft")
DRAFT_REFERENCE = "mlx-lm-draft"
DEFAULT_NUM_DRAFT = (2, 4, 8)

# Target name → the named model mlx-lm drafts with by default (the same tokenizer, a third the size).
DEFAULT_DRAFT_MODELS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}

# Texts both tokenizers must encode alike: prose, code, digits, whitespace runs, non-ASCII, chat markers.
_PROBES = (
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n\tx = [1, 2, 3]\n",
    "Solve 12345 * 678 = ? and 3.14159.",
    "naïve café — 東京 🙂 Ωmega",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "   leading and trailing   \n\n",
)


def draft_model_name(target: str, given: str | None) -> str:
    """The draft model for `target`: `given`, else the target's default partner.

    Raises:
        InvalidRequest: none given and the target has no default draft model.
    """
    if given:
        return given
    if target in DEFAULT_DRAFT_MODELS:
        return DEFAULT_DRAFT_MODELS[target]
    pairs = ", ".join(f"{t} → {d}" for t, d in DEFAULT_DRAFT_MODELS.items())
    raise InvalidRequest(
        message=f"--against {DRAFT_REFERENCE} needs --draft-model NAME|DIR: model {target!r} has no default draft "
        f"model (defaults: {pairs})",
        param="draft_model",
    )


def check_shared_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Target and draft must score the same token ids and tokenize alike (vocabulary, EOS, encodings, decodings).

    Raises:
        InvalidRequest: they differ; the message says where.
    """

    def fail(what: str) -> InvalidRequest:
        return InvalidRequest(
            message=f"draft model {draft.name!r} does not share the vocabulary of {target.name!r}: {what}",
            param="draft_model",
        )

    if draft.target.vocab_size != target.target.vocab_size:
        raise fail(f"{draft.target.vocab_size} logits against {target.target.vocab_size}")
    a, b = target.tokenizer, draft.tokenizer
    if a.vocab_size != b.vocab_size:
        raise fail(f"tokenizer of {b.vocab_size} tokens against {a.vocab_size}")
    if a.eos_ids != b.eos_ids:
        raise fail(f"end-of-sequence ids {sorted(b.eos_ids)} against {sorted(a.eos_ids)}")
    for text in _PROBES:
        if a.encode(text) != b.encode(text):
            raise fail(f"{text!r} tokenizes differently")
    n = a.vocab_size
    for i in sorted({*range(0, n, max(1, n // 256)), *range(max(0, n - 64), n)}):
        if a.decode([i]) != b.decode([i]):
            raise fail(f"token {i} decodes differently")


def load_draft_model(loader: ModelLoader, target: LoadedModel, given: str | None) -> LoadedModel:
    """The draft model for `target` (given or its default), loaded and checked against the target's vocabulary."""
    draft = loader.load_target(draft_model_name(target.name, given))
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
