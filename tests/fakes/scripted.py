"""A target model whose reply is chosen by a Python function of the prompt text (tool calls, thinking, …).

Built on OracleTarget, so it runs through the real decode loop, detokenizer, stop strings and budgets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.domain.errors import ModelUnavailable
from mlx_dspark.domain.ports import DraftSource
from mlx_dspark.domain.tokens import SamplingParams
from tests.fakes.oracle import OracleTarget
from tests.fakes.tokenizer import FakeTokenizer

Responder = Callable[[str], str]


def echo_responder(prompt: str) -> str:
    return "Hello from the scripted model."


class ScriptedTarget(OracleTarget):
    """After each prefill, greedily emits `responder(prompt_text)` and then EOS.

    Attributes:
        prompts: every full prompt text seen, in order.
        emitted: tokens emitted per request (for cancellation checks).
        gate: when set to a threading.Event, each verify waits for it (holds a request mid-generation).
    """

    def __init__(self, tokenizer: FakeTokenizer, responder: Responder = echo_responder) -> None:
        super().__init__(vocab=tokenizer.vocab_size, context=1, logits_fn=self._scripted_logits)
        self.tokenizer = tokenizer
        self.responder = responder
        self._prompt_len = 0
        self._reply: list[int] = []
        self.prompts: list[str] = []
        self.emitted: list[int] = []
        self.gate: threading.Event | None = None
        self.reached_gate = threading.Event()

    def prefill(self, tokens: Sequence[int], sampling: SamplingParams, uniform: float) -> int:
        prompt = [*self.rows, *tokens]
        self._prompt_len = len(prompt)
        text = self.tokenizer.decode(prompt)
        self.prompts.append(text)
        reply = self.responder(text)
        self._reply = [*self.tokenizer.encode(reply, add_special_tokens=False), self.tokenizer.eos_id]
        self.emitted.append(0)
        return super().prefill(tokens, sampling, uniform)

    def verify(self, anchor, block, sampling, uniforms, *, ahead=None):  # type: ignore[no-untyped-def]
        if self.gate is not None:
            self.reached_gate.set()
            self.gate.wait()
        self.emitted[-1] += 1
        return super().verify(anchor, block, sampling, uniforms, ahead=ahead)

    def _scripted_logits(self, prefix: Sequence[int]) -> list[float]:
        i = len(prefix) - self._prompt_len
        token = self._reply[i] if 0 <= i < len(self._reply) else self.tokenizer.eos_id
        out = [0.0] * self.vocab_size
        out[token] = 10.0
        return out


class ScriptedLoader:
    """The ModelLoader port over one scripted model; no drafters (plain decoding)."""

    def __init__(
        self,
        responder: Responder = echo_responder,
        *,
        name: str = "local-model",
        context_window: int = 1_000_000,
        tokenizer: FakeTokenizer | None = None,
        family: str = "qwen3",
    ) -> None:
        self.tokenizer = tokenizer or FakeTokenizer()
        self.target = ScriptedTarget(self.tokenizer, responder)
        self.model = LoadedModel(
            name=name,
            identity=f"scripted:{name}",
            target=self.target,
            tokenizer=self.tokenizer,
            context_window=context_window,
            family=family,
        )
        self.loads = 0

    def load_target(self, name: str) -> LoadedModel:
        self.loads += 1
        return self.model

    def load_drafter(self, kind: str, spec: str | None, model: LoadedModel, *, bits: int | None) -> DraftSource:
        raise ModelUnavailable(message=f"no {kind} drafter for the scripted model")

    def available_drafters(self, model: LoadedModel) -> Sequence[str]:
        return []

    def drafter_kind(self, spec: str) -> str | None:
        return None
