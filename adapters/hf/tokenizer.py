"""The Tokenizer port over a Hugging Face fast tokenizer (as wrapped by mlx-lm's TokenizerWrapper)."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.model import ChatMessages, TemplateVars, ToolSpecs

# Special tokens that close a turn in common chat formats; generation stops on them too.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>")


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _json_field(path: Path, key: str) -> Any:
    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def collect_eos_ids(tokenizer: Any, model_dir: Path | None = None, extra: Iterable[int] = ()) -> frozenset[int]:
    """Every id that ends generation.

    Gathered from the tokenizer's eos, config.json and generation_config.json `eos_token_id` (int or list),
    mlx-lm's `eos_token_ids`, and special end-of-turn tokens (`<|im_end|>`, `<end_of_turn>`, …) in the vocabulary.

    Args:
        tokenizer: an HF tokenizer or mlx-lm TokenizerWrapper.
        model_dir: the checkpoint directory, for config.json and generation_config.json.
        extra: ids to add.
    """
    ids: set[int] = set(extra)
    ids.update(_ids(getattr(tokenizer, "eos_token_ids", None)))
    ids.update(_ids(getattr(tokenizer, "eos_token_id", None)))
    if model_dir is not None:
        for name in ("config.json", "generation_config.json"):
            ids.update(_ids(_json_field(model_dir / name, "eos_token_id")))
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    added = hf.get_added_vocab() if hasattr(hf, "get_added_vocab") else {}
    ids.update(added[t] for t in END_OF_TURN_TOKENS if t in added)
    return frozenset(ids)


class HfTokenizer:
    """Tokenizer port over an HF fast tokenizer (or an mlx-lm TokenizerWrapper around one).

    Args:
        tokenizer: the HF tokenizer or TokenizerWrapper; the wrapper is kept as `wrapper` for mlx-lm calls.
        eos_ids: the stop ids (see `collect_eos_ids`); computed from the tokenizer when None.
    """

    def __init__(self, tokenizer: Any, eos_ids: Iterable[int] | None = None) -> None:
        # Every call goes through one lock: the engine thread detokenizes while a server worker may check a
        # queued request's prompt, and an HF tokenizer is not documented as safe for concurrent use.
        self._lock = threading.RLock()
        self.wrapper = tokenizer
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._eos = frozenset(eos_ids) if eos_ids is not None else collect_eos_ids(tokenizer)
        self._vocab_size = len(self._hf)

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end generation."""
        return self._eos

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows (added tokens included); the model's logits may be wider."""
        return self._vocab_size

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids of every special token (added tokens marked special and the tokenizer's own), sorted."""
        added = getattr(self._hf, "added_tokens_decoder", {}) or {}
        special = {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
        special |= {int(i) for i in getattr(self._hf, "all_special_ids", []) or []}
        return tuple(sorted(special))

    @property
    def reserved_ids(self) -> tuple[int, ...]:
        """The bos, pad, unk and eos ids the tokenizer declares (training never targets them)."""
        reserved = {getattr(self._hf, f"{k}_token_id", None) for k in ("bos", "pad", "unk", "eos")}
        return tuple(sorted(int(i) for i in reserved if isinstance(i, int)))

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token's text (the loader reads it once, on the thread that owns the
        tokenizer; a partial byte decodes to U+FFFD's three bytes, which only loosens the bound)."""
        ids = [[i] for i in range(self._vocab_size)]
        backend = getattr(self._hf, "backend_tokenizer", None)
        with self._lock:
            if backend is not None:
                texts = backend.decode_batch(ids, skip_special_tokens=False)
            else:
                texts = self._hf.batch_decode(ids, skip_special_tokens=False)
        return max((len(t.encode("utf-8")) for t in texts), default=0)

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template, or None for base models without one."""
        template = getattr(self._hf, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one is what render_chat uses
            template = template.get("default")
        return template if isinstance(template, str) else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with BOS etc. when the tokenizer adds them and `add_special_tokens`)."""
        with self._lock:
            return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included (stop handling is the caller's)."""
        with self._lock:
            return str(self._hf.decode(list(ids), skip_special_tokens=False))

    def render_chat(
        self, messages: ChatMessages, *, tools: ToolSpecs | None = None, template_kwargs: TemplateVars | None = None
    ) -> str:
        """The conversation rendered through the tokenizer's chat template (text, not ids).

        Raises:
            InvalidRequest: the model has no chat template, or the template rejects the conversation.
        """
        # The mlx-lm wrapper knows custom renderers and the model's thinking switch; prefer it.
        has_template = getattr(self.wrapper, "has_chat_template", self.chat_template is not None)
        renderer = self.wrapper if hasattr(self.wrapper, "has_chat_template") else self._hf
        if not has_template:
            raise InvalidRequest(
                message="this model has no chat template (a base model); send a plain-text prompt instead",
                param="messages",
            )
        try:
            with self._lock:
                text = renderer.apply_chat_template(
                    [dict(m) for m in messages],
                    tools=[dict(t) for t in tools] if tools else None,
                    add_generation_prompt=True,
                    tokenize=False,
                    **dict(template_kwargs or {}),
                )
        except Exception as exc:  # Jinja raises TemplateError (and templates raise_exception) on bad input
            raise InvalidRequest(
                message=f"the chat template rejected the conversation: {exc}", param="messages"
            ) from exc
        return str(text)
