"""Use case: generate text for one request on a loaded model with a chosen draft source.

The CLI, the Python API and the server all come through here; it owns detokenization, stop strings,
prefix reuse across requests and the per-request telemetry, and runs the one decode loop.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from mlx_dspark.application.detokenizer import IncrementalDetokenizer
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.application.prefix_cache import PrefixCache
from mlx_dspark.domain.cache import common_prefix
from mlx_dspark.domain.costmodel.draft_cap import CapPolicy
from mlx_dspark.domain.decoder import RequestDecoder, Work
from mlx_dspark.domain.drafting.selection import PLAIN, FixedSelector, SourceSelector
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.events import (
    DecodeEvent,
    Finished,
    PrefixReused,
    RoundFinished,
    SourceSwitched,
    TokensCommitted,
)
from mlx_dspark.domain.ports import Clock, DraftSource, TargetModel, TelemetrySink
from mlx_dspark.domain.stops import StopStringMatcher
from mlx_dspark.domain.tokens import FinishReason, SamplingParams, StopRule

Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int]
# (model, chat messages, tool specs, template variables) -> prompt ids, through the family codec
ChatPrompt = Callable[
    [LoadedModel, Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None, Mapping[str, Any] | None], list[int]
]


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """One request in neutral terms.

    Attributes:
        prompt: plain text, a list of chat messages ({"role", "content"}), or token ids.
        max_tokens: the hard cap on generated tokens.
        sampling: temperature, top-p, top-k, seed.
        stop: stop strings; generation ends before the first one and reports it.
        chat_template: render text prompts through the chat template as one user message.
        tools: tool specs handed to the chat template.
        template_kwargs: extra chat-template variables (e.g. enable_thinking).
        request_id: for logs and telemetry.
        boundaries: prompt lengths where a later turn's prompt will still agree (ends of the system
            prompt and of user turns, measured on the template); snapshot candidates.
        prefix_cache: reuse and remember cached prefixes (False: a cold start, e.g. for the bench).
    """

    prompt: Prompt
    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    chat_template: bool = True
    tools: tuple[Mapping[str, Any], ...] | None = None
    template_kwargs: Mapping[str, Any] | None = None
    request_id: str = attrs.Factory(lambda: uuid.uuid4().hex[:12])
    boundaries: tuple[int, ...] = ()
    prefix_cache: bool = True


@attrs.frozen(kw_only=True)
class TextChunk:
    """New text and the token ids committed with it."""

    text: str
    token_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class GenerationResult:
    """Everything the CLI's --json and the API report about one request."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    stop_sequence: str | None
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    rounds: int
    drafted: int
    accepted: int
    mean_accepted: float
    tokens_per_second: float
    end_to_end_tokens_per_second: float
    time_to_first_token_s: float
    prefill_s: float
    decode_s: float
    mode: str
    cap: int
    source: str = PLAIN  # the draft source that ran last (auto mode may switch, also within the request)
    cap_histogram: Mapping[int, int] = attrs.field(factory=dict)  # rounds per draft cap
    source_switches: int = 0  # auto: moves from one source to another within this request
    source_rounds: Mapping[str, int] = attrs.field(factory=dict)  # auto: rounds each source ran


@attrs.frozen(kw_only=True)
class GenerationDone:
    result: GenerationResult


GenerationEvent = TextChunk | GenerationDone


class GenerationService:
    """Runs requests one at a time on one model (the engine thread owns one of these).

    Args:
        model: the loaded target.
        clock: monotonic time.
        telemetry: receives every decode event (and SourceSwitched when the selector switches).
        selector: picks the (draft source, cap policy) of each request; for a fixed mode pass
            `source`, `mode` and `cap_policy_factory` instead (a FixedSelector over them).
        source: the fixed mode's draft source, or None for plain decoding.
        mode: the fixed mode's name, reported in results.
        cap_policy_factory: the fixed mode's fresh cap policy per request (None = the source's full block).
        prefix_cache: cached prefixes of this model (None = reuse only what the target still holds).
        chat_prompt: renders chat messages to prompt ids through the model family's codec, as the server does
            (None: through the tokenizer's own template).
    """

    def __init__(
        self,
        model: LoadedModel,
        *,
        clock: Clock,
        telemetry: TelemetrySink,
        selector: SourceSelector | None = None,
        source: DraftSource | None = None,
        mode: str = PLAIN,
        cap_policy_factory: Callable[[], CapPolicy] | None = None,
        prefix_cache: PrefixCache | None = None,
        chat_prompt: ChatPrompt | None = None,
    ) -> None:
        self.model = model
        self._chat_prompt = chat_prompt
        self.selector: SourceSelector = selector or FixedSelector(mode, source, cap_policy_factory)
        self._clock = clock
        self._telemetry = telemetry
        self.prefix_cache = prefix_cache

    @property
    def mode(self) -> str:
        """The mode name ("auto" or a fixed mode)."""
        return self.selector.mode

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def telemetry(self) -> TelemetrySink:
        """Where this service's events go (the batch scheduler reports its ticks there too)."""
        return self._telemetry

    def on_target(self, target: TargetModel, *, selector: SourceSelector | None = None) -> GenerationService:
        """The same service over another target (a batched row), sharing clock, telemetry, prefix cache (a
        target that cannot save states, `state_tag` "", reuses only its live rows) and the selector, unless
        `selector` replaces it (a batched row's own fork of the draft source)."""
        return GenerationService(
            attrs.evolve(self.model, target=target),
            clock=self._clock,
            telemetry=self._telemetry,
            selector=selector or self.selector,
            prefix_cache=self.prefix_cache,
            chat_prompt=self._chat_prompt,
        )

    def encode_prompt(self, request: GenerationRequest) -> list[int]:
        """Token ids of the request's prompt, through the chat template where asked."""
        tok = self.model.tokenizer
        prompt = request.prompt
        if isinstance(prompt, str):
            if not (request.chat_template and tok.chat_template):
                return tok.encode(prompt)
            messages: Sequence[Mapping[str, Any]] = [{"role": "user", "content": prompt}]
        elif all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]  # type: ignore[arg-type]
        else:
            messages = prompt  # type: ignore[assignment]
        if not tok.chat_template:
            raise InvalidRequest(message="this model has no chat template; send a text prompt", param="messages")
        if self._chat_prompt is not None:
            return self._chat_prompt(self.model, messages, request.tools, request.template_kwargs)
        text = tok.render_chat(messages, tools=request.tools, template_kwargs=request.template_kwargs)
        return tok.encode(text, add_special_tokens=False)

    def stream(
        self, request: GenerationRequest, prompt_ids: Sequence[int] | None = None
    ) -> Iterator[GenerationEvent]:
        """Yield text deltas, then one GenerationDone; closing the iterator cancels the request. The request
        runs on the step engine as a batch of one over this service's target."""
        from mlx_dspark.application.engine.rows import SerialRows
        from mlx_dspark.application.engine.step import Engine

        items: list[Any] = []

        def make(row: Any) -> GenerationJob:
            return GenerationJob(self, request, items.append, prompt_ids=prompt_ids)

        yield from Engine(SerialRows(self.model.target), self, fork=False, report_steps=False).run_alone(make, items)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run a request to completion."""
        for event in self.stream(request):
            if isinstance(event, GenerationDone):
                return event.result
        raise AssertionError("the stream ended without a result")


class GenerationJob:
    """One request of a GenerationService as the step engine drives it: the decode loop over the service's
    target (a row), with detokenization, stop strings, prefix reuse and the request's telemetry around it.

    Emits TextChunks (every committed id, its text held back only by a possible stop string or an unfinished
    character), then one GenerationDone. Construction runs the request's checks and prefix lookup.
    """

    def __init__(
        self,
        service: GenerationService,
        request: GenerationRequest,
        emit: Callable[[GenerationEvent], None],
        *,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self._service = service
        self._request = request
        self._emit = emit
        ids = list(prompt_ids) if prompt_ids is not None else service.encode_prompt(request)
        if not ids:
            raise InvalidRequest(message="the prompt encodes to no tokens", param="prompt")
        self._ids = ids
        model, telemetry, clock = service.model, service.telemetry, service.clock
        self._telemetry, self._clock = telemetry, clock
        stop_rule = StopRule(max_tokens=request.max_tokens, eos_ids=model.tokenizer.eos_ids)
        self._selection = selection = service.selector.select(ids, request.sampling)
        if selection.switched is not None:
            telemetry.emit(request.request_id, selection.switched)
        target = self._target = model.target
        cache = self._cache = service.prefix_cache if request.prefix_cache else None
        points: tuple[int, ...] = ()
        if cache is not None:
            found = cache.prepare(target, ids)
            reuse, origin = found.rows, found.source
            points = cache.snapshot_points(target, request.boundaries, start=reuse, end=len(ids))
        else:
            # Ask the target what it holds: other users of the same target (bench, calibration) move it too.
            reuse = common_prefix(target.cached_ids, ids) if request.prefix_cache else 0
            reuse = min(reuse, len(ids) - 1)  # the loop prefills at least the prompt's last token
            origin = "live" if reuse else "none"
        telemetry.emit(request.request_id, PrefixReused(prompt_tokens=len(ids), rows=reuse, source=origin))
        self._detok = IncrementalDetokenizer(model.tokenizer)
        self._matcher = StopStringMatcher(request.stop)
        self._start = clock.now()
        self._first_token_at: float | None = None
        self._tokens: list[int] = []
        self._text: list[str] = []
        self._caps: Counter[int] = Counter()
        self._running = selection.name  # auto may move the request between rounds (SourceSwitched)
        self._source_rounds: Counter[str] = Counter()
        self._switches = 0
        self._matched: str | None = None
        self._decoder = RequestDecoder(
            target,
            ids,
            request.sampling,
            stop_rule,
            clock,
            self._on_event,
            selection=selection,
            reuse_prefix=reuse,
            context_window=model.context_window,
            halt=lambda: self._matched is not None,
            snapshots=points,
            on_snapshot=None if cache is None else lambda: cache.remember(target),
        )

    def work(self) -> Work | None:
        return self._decoder.work()

    def advance(self, result: Any) -> int | None:
        return self._decoder.advance(result)

    def cancel(self) -> None:
        """The client went away: the rows are consistent between rounds, so the prefix is remembered."""
        self._decoder.cancel()
        if self._cache is not None:
            self._cache.remember(self._target)

    def _on_event(self, event: DecodeEvent) -> None:
        request = self._request
        if isinstance(event, Finished):
            self._finish(event)
            return
        self._telemetry.emit(request.request_id, event)
        if isinstance(event, TokensCommitted):
            if self._first_token_at is None:
                self._first_token_at = self._clock.now()
            if self._matched is not None:  # pragma: no cover - the loop halts at the end of the round
                return
            # With stop strings, text goes one token at a time: the ids kept end at the stop.
            steps = [event.tokens] if not request.stop else [(t,) for t in event.tokens]
            emitted: list[str] = []
            kept: list[int] = []
            for step in steps:
                kept.extend(step)
                check = self._matcher.feed(self._detok.add(step))
                emitted.append(check.emit)
                if check.matched is not None:
                    self._matched = check.matched
                    break
            self._tokens.extend(kept)
            text = "".join(emitted)
            if text:
                self._text.append(text)
            self._emit(TextChunk(text=text, token_ids=tuple(kept)))  # every committed id streams
        elif isinstance(event, RoundFinished):
            self._caps[event.cap] += 1
            self._source_rounds[self._running] += 1
        elif isinstance(event, SourceSwitched):
            self._running = event.new
            self._switches += 1

    def _finish(self, finished: Finished) -> None:
        request, ids = self._request, self._ids
        if self._cache is not None:
            self._cache.remember(self._target)
        if self._matched is None:
            tail = self._matcher.feed(self._detok.flush()).emit + self._matcher.flush()
            if tail:
                self._text.append(tail)
                self._emit(TextChunk(text=tail, token_ids=()))
        end = self._clock.now()
        # Tokens past a stop string were generated in its round but are not output; nor can more of the
        # prompt be cached than the prompt.
        usage = attrs.evolve(
            finished.usage,
            generated_tokens=len(self._tokens),
            cached_prompt_tokens=min(finished.usage.cached_prompt_tokens, len(ids)),
            source_switches=self._switches,
            source_rounds=dict(sorted(self._source_rounds.items())),
        )
        reason = FinishReason.STOP_SEQUENCE if self._matched is not None else finished.reason
        done = Finished(reason=reason, usage=usage, stop_sequence=self._matched)
        self._telemetry.emit(request.request_id, done)
        self._service.selector.finished(self._selection, usage)
        first = self._first_token_at
        ttft = (first - self._start) if first is not None else end - self._start
        decode_s = max(end - (first or end), 1e-9)
        n = len(self._tokens)
        self._emit(
            GenerationDone(
                result=GenerationResult(
                    text="".join(self._text),
                    token_ids=tuple(self._tokens),
                    finish_reason=reason,
                    stop_sequence=self._matched,
                    prompt_tokens=len(ids),
                    cached_prompt_tokens=usage.cached_prompt_tokens,
                    generated_tokens=n,
                    rounds=usage.rounds,
                    drafted=usage.drafted,
                    accepted=usage.accepted,
                    mean_accepted=usage.mean_accepted,
                    tokens_per_second=max(n - 1, 0) / decode_s if n > 1 else 0.0,
                    end_to_end_tokens_per_second=n / max(end - self._start, 1e-9),
                    time_to_first_token_s=ttft,
                    prefill_s=usage.prefill_s,
                    decode_s=usage.decode_s,
                    mode=self._service.mode,
                    cap=max(self._caps, default=0),
                    source=usage.source,
                    cap_histogram=dict(sorted(self._caps.items())),
                    source_switches=self._switches,
                    source_rounds=usage.source_rounds,
                )
            )
        )


class MonotonicClock:
    """time.perf_counter as the Clock port (application-level default; no I/O)."""

    def now(self) -> float:
        return time.perf_counter()


__all__ = [
    "GenerationDone",
    "GenerationEvent",
    "GenerationJob",
    "GenerationRequest",
    "GenerationResult",
    "GenerationService",
    "MonotonicClock",
    "TextChunk",
]
