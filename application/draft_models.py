"""Draft models: a small model of the target's own vocabulary as a draft source (`--mode draft`), which model
drafts for a target by default, and the check that the two really share one vocabulary (speculation compares
token ids, so two tokenizers that disagree would compare nothing). The lab's `bench --against mlx-lm-draft`
uses the same pairing and check.
"""

from __future__ import annotations

from mlx_dspark.application.ports import LoadedModel, ModelLoader
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.ports import DraftSource

DRAFT = "draft"  # the mode and the source's name

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


def draft_model_name(target: str, given: str | None, *, needed_by: str = "--mode draft") -> str:
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
        message=f"{needed_by} needs --draft-model NAME|DIR: model {target!r} has no default draft "
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


def configured(target: str, given: str | None) -> bool:
    """Whether `target` has a draft model: one given, or its default partner."""
    return bool(given) or target in DEFAULT_DRAFT_MODELS


def load_source(loader: ModelLoader, target: LoadedModel, given: str | None) -> DraftSource:
    """The draft-model source for `target`: the draft model loaded and checked against its vocabulary.

    Raises:
        InvalidRequest: no draft model for this target, or one that does not share its vocabulary.
        ModelUnavailable: the draft model cannot be found.
    """
    draft = loader.load_target(draft_model_name(target.name, given))
    check_shared_vocabulary(target, draft)
    return loader.draft_model_source(draft)
