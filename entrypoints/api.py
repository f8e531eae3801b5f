"""The Python API: `mlx_dspark.load(...)` → a SpeculativeModel with generate() and stream(). Thin over the use cases."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from mlx_dspark.application import bootstrap
from mlx_dspark.application.generation import (
    GenerationDone,
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    GenerationService,
    Prompt,
    TextChunk,
)
from mlx_dspark.application.modes import build_generator
from mlx_dspark.application.services import Services
from mlx_dspark.application.settings import Settings, load_settings
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.entrypoints.log_config import library_logging

__all__ = ["GenerationDone", "GenerationResult", "SpeculativeModel", "TextChunk", "load"]


class SpeculativeModel:
    """A loaded model with its draft source. Not thread-safe: one request at a time (the server serializes).

    Results carry the same fields as `mlx-dspark generate --json`.
    """

    def __init__(self, generator: GenerationService, settings: Settings) -> None:
        self._gen = generator
        self.settings = settings

    @property
    def mode(self) -> str:
        return self._gen.mode

    @property
    def model(self) -> str:
        return self._gen.model.identity

    def _request(
        self,
        prompt: Prompt,
        *,
        max_tokens: int | None,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        seed: int | None,
        stop: str | Sequence[str] | None,
        chat_template: bool,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> GenerationRequest:
        d = self.settings.decode
        sampling = SamplingParams(
            temperature=d.temperature if temperature is None else temperature,
            top_p=d.top_p if top_p is None else top_p,
            top_k=d.top_k if top_k is None else top_k,
            seed=d.seed if seed is None else seed,
        )
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        return GenerationRequest(
            prompt=prompt,
            max_tokens=d.max_tokens if max_tokens is None else max_tokens,
            sampling=sampling,
            stop=stops,
            chat_template=chat_template,
            tools=tuple(tools) if tools else None,
        )

    def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        chat_template: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Iterator[GenerationEvent]:
        """Yield TextChunk events, then one GenerationDone with the result.

        Args:
            prompt: text (sent through the chat template unless chat_template=False), a list of
                {"role", "content"} messages, or token ids.
            max_tokens: hard cap on generated tokens.
            temperature: 0 = greedy (token-for-token equal to plain greedy decoding).
            top_p: nucleus truncation, applied identically to target and drafter.
            top_k: top-k truncation (0 = off).
            seed: makes sampling reproducible.
            stop: stop string(s); the result reports which one matched.
            chat_template: render text prompts through the model's chat template.
            tools: tool specs passed to the chat template.
        """
        req = self._request(
            prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=stop, chat_template=chat_template, tools=tools,
        )
        yield from self._gen.stream(req)

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        """Run to completion; same arguments as stream()."""
        for event in self.stream(prompt, **kwargs):
            if isinstance(event, GenerationDone):
                return event.result
        raise AssertionError("the stream ended without a result")


def load(
    model: str = "default",
    *,
    mode: str = "auto",
    drafter: str | None = None,
    draft_model: str | None = None,
    max_draft: int | str = "auto",
    drafter_bits: int | None = None,
    services: Services | None = None,
    **settings: Any,
) -> SpeculativeModel:
    """Load a target (and its draft source) and return a SpeculativeModel.

    Args:
        model: "default" (embedded SmolLM2-135M-Instruct), a local dir, a Hugging Face repo id, or a .gguf file.
        mode: "auto" (measured winner), "baseline", "lookup", "dflash", "dspark" or "draft".
        drafter: drafter checkpoint (local dir or repo id) for dflash/dspark.
        draft_model: the draft model of mode "draft" (a named model, local dir, repo id or .gguf of the
            target's vocabulary; default: the target's partner, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b).
        max_draft: draft cap per round, or "auto" (from measured cost curves).
        drafter_bits: quantize the drafter on load (4, 8, 0 = off; None = faster on this device).
        services: pre-wired services (tests pass fakes through bootstrap.build).
        **settings: any other settings field (temperature, max_tokens, cache_dir, ...) as defaults.
    """
    library_logging()
    flags = {"model": model, "mode": mode, "drafter": drafter, "draft_model": draft_model, "max_draft": str(max_draft),
             "drafter_bits": drafter_bits, **settings}
    resolved = load_settings(flags)
    if services is None:
        bootstrap.runtime().prepare()
        services = bootstrap.build(resolved)
    return SpeculativeModel(build_generator(services, resolved), resolved)
