"""A loaded target as use cases see it, the Tokenizer port its adapter provides, and a reference decoder's
timed run (pure values)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from mlx_dspark.domain.ports import TargetModel

ChatMessages = Sequence[Mapping[str, Any]]  # {"role", "content", ...} dicts, as chat templates read them
ToolSpecs = Sequence[Mapping[str, Any]]  # JSON tool specs handed to the chat template
TemplateVars = Mapping[str, Any]  # extra chat-template variables (e.g. enable_thinking)


class Tokenizer(Protocol):
    """Text ↔ token ids and the model's own chat template."""

    @property
    def eos_ids(self) -> frozenset[int]: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token's text (0: unknown): the admission bound's divisor."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(
        self, messages: ChatMessages, *, tools: ToolSpecs | None = None, template_kwargs: TemplateVars | None = None
    ) -> str:
        """The conversation rendered through the tokenizer's chat template (text, not ids), ending with the
        generation prompt."""
        ...


@attrs.frozen(kw_only=True)
class LoadedModel:
    """A target ready to decode, with what use cases need to know about it.

    Attributes:
        name: what the user asked for ("default", a repo id, a path).
        identity: a stable identity for cache keys (repo id or path + revision or content hash).
        target: the model behind the TargetModel port.
        tokenizer: its tokenizer.
        context_window: its maximum context length in tokens.
        family: the model family (HF model_type), which picks the family codec.
        handle: adapter-private object (the MLX module etc.) that drafter loaders need; opaque here.
    """

    name: str
    identity: str
    target: TargetModel
    tokenizer: Tokenizer
    context_window: int
    family: str
    handle: Any = None


@attrs.frozen(kw_only=True)
class TrainingTarget:
    """A target opened for drafter distillation (no decode wrapper: training runs its own forwards).

    Attributes:
        name: what the user asked for.
        identity: stable identity (recorded in the model card).
        tokenizer: its tokenizer.
        handle: adapter-private model object, passed back to the trainer.
        tokenizer_size: tokens the tokenizer knows (embedding rows past this are spare).
        special_ids: the tokenizer's special/added token ids (mask-token candidates).
        reserved_ids: BOS/PAD/UNK and similar ids that must never be the mask.
    """

    name: str
    identity: str
    tokenizer: Tokenizer
    handle: Any
    tokenizer_size: int
    special_ids: tuple[int, ...] = ()
    reserved_ids: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class ReferenceRun:
    """One greedy request decoded by a reference implementation, timed as ours is.

    Attributes:
        token_ids: the generated ids (an EOS ends them and is not included, as in ours).
        prefill_s: prompt in → first token on the host.
        decode_s: first token → last token on the host.
        rounds: target forwards after the prompt that produced the tokens (a speculative reference's
            verify rounds); None = one per token.
    """

    token_ids: tuple[int, ...]
    prefill_s: float
    decode_s: float
    rounds: int | None = None

    @property
    def tokens_per_second(self) -> float:
        """Decode tok/s, counted as ours: tokens after the first ÷ the time after the first."""
        n = len(self.token_ids)
        return (n - 1) / self.decode_s if n > 1 and self.decode_s > 0 else 0.0
