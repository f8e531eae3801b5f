"""The one decode loop every mode runs: prefill, then rounds of draft → verify → accept → commit/rollback.

Plain decoding is this loop with no draft source (cap 0), so budget, stop and sampling rules are the
same in every mode by construction. Its speed comes from the target: when the next round is known to be
another plain step, the loop hands over that step's uniform (`ahead`) so the target can queue it before
the host reads the current token. Uniforms are drawn in the same order either way.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator, Sequence

from mlx_dspark.application.prefill import prefill
from mlx_dspark.domain.budget import plan_commit, round_cap
from mlx_dspark.domain.costmodel.acceptance import AcceptanceStats
from mlx_dspark.domain.costmodel.draft_cap import CapPolicy, FixedCap
from mlx_dspark.domain.drafting.block import EMPTY_BLOCK, DraftContext
from mlx_dspark.domain.drafting.selection import PLAIN
from mlx_dspark.domain.errors import ContextTooLong, InvalidRequest
from mlx_dspark.domain.events import CapChanged, DecodeEvent, Finished, RoundFinished, TokensCommitted, Usage
from mlx_dspark.domain.ports import Clock, DraftSource, TargetModel
from mlx_dspark.domain.tokens import FinishReason, SamplingParams, StopRule


def decode(
    target: TargetModel,
    prompt: Sequence[int],
    sampling: SamplingParams,
    stop: StopRule,
    clock: Clock,
    *,
    source: DraftSource | None = None,
    cap_policy: CapPolicy | None = None,
    reuse_prefix: int = 0,
    context_window: int | None = None,
    halt: Callable[[], bool] | None = None,
    snapshots: Sequence[int] = (),
    on_snapshot: Callable[[], object] | None = None,
) -> Generator[DecodeEvent, None, None]:
    """Generate from `prompt`, yielding events; closing the iterator cancels the request.

    Args:
        target: the model that decides every token.
        prompt: prompt token ids (at least one).
        sampling: temperature, truncation and seed.
        stop: max_tokens and EOS ids.
        clock: monotonic time source.
        source: the draft source, or None for plain decoding.
        cap_policy: how many drafts per round; defaults to the source's full block.
        reuse_prefix: leading prompt tokens whose rows are already in the target's cache.
        context_window: the target's context length, enforced before every round.
        halt: asked after each commit's events; True ends the request as STOP_SEQUENCE (the caller saw a
            stop string), with this round's real accounting in Finished.
        snapshots: prompt lengths at which `on_snapshot` saves the target's state during prefill.
        on_snapshot: called when the cache holds exactly a snapshot point's rows.

    Yields:
        PrefillProgress (long prompts), TokensCommitted, RoundFinished and CapChanged events, then
        exactly one Finished.
    """
    if not prompt:
        raise InvalidRequest(message="the prompt is empty", param="prompt")
    if context_window is not None and len(prompt) >= context_window:
        raise ContextTooLong(
            message=f"prompt of {len(prompt)} tokens does not fit the context window of {context_window}",
            limit=context_window,
            requested=len(prompt),
        )
    rng = random.Random(sampling.seed)
    if source is None:
        policy: CapPolicy = FixedCap(0)
    else:
        policy = cap_policy or FixedCap(source.max_block)
        source.begin(prompt)
    wants_features = source is not None and source.uses_features
    reuse = target.reset(keep=max(0, min(reuse_prefix, len(prompt) - 1)), capture=wants_features)

    start = clock.now()
    first = yield from prefill(
        target, prompt, reuse, sampling, rng.random(), snapshots=snapshots, on_snapshot=on_snapshot
    )
    prefill_s = clock.now() - start
    history = list(prompt)
    stats = AcceptanceStats()
    generated = 0
    plan = plan_commit((first,), generated, stop)
    if plan.tokens:
        history.extend(plan.tokens)
        generated += len(plan.tokens)
        yield TokensCommitted(tokens=plan.tokens)
    finish = plan.finish
    if finish is None and halt is not None and halt():
        finish = FinishReason.STOP_SEQUENCE
    decode_start = clock.now()

    def usage() -> Usage:
        return Usage(
            prompt_tokens=len(prompt),
            generated_tokens=generated,
            cached_prompt_tokens=reuse,
            rounds=stats.rounds,
            drafted=stats.drafted,
            accepted=sum(stats.accepts),
            mean_accepted=stats.mean_accepted,
            prefill_s=prefill_s,
            decode_s=clock.now() - decode_start,
            source=source.name if source is not None else PLAIN,
        )

    index = 0
    queued: float | None = None  # the uniform of a plain step the target may already have queued
    while finish is None:
        depth = target.cached_tokens
        if context_window is not None and depth + 1 >= context_window:
            finish = FinishReason.CONTEXT
            break
        requested = policy.cap(depth) if source is not None else 0
        cap = round_cap(requested, stop.max_tokens - generated)
        if context_window is not None:
            cap = max(0, min(cap, context_window - depth - 2))
        anchor = history[-1]
        t0 = clock.now()
        block = EMPTY_BLOCK
        if source is not None and cap > 0:
            features = target.take_features() if source.uses_features else None
            ctx = DraftContext(anchor=anchor, position=depth, history=history, features=features)
            cap = min(cap, source.max_block)
            block = source.propose(ctx, cap, sampling, [rng.random() for _ in range(cap)])
            block = block.truncated(cap)
        t1 = clock.now()
        if len(block):
            uniforms = [rng.random() for _ in range(len(block) + 1)]
        else:
            uniforms = [queued if queued is not None else rng.random()]
        queued = None
        # Plain mode: the next round is another plain step unless this one ends the request.
        if source is None and generated + 1 < stop.max_tokens and (
            context_window is None or depth + 2 < context_window
        ):
            queued = rng.random()
        verdict = target.verify(anchor, block, sampling, uniforms, ahead=queued)
        candidates = (*block.tokens[: verdict.accepted], verdict.next_token)
        plan = plan_commit(candidates, generated, stop)
        target.commit(plan.keep_rows)
        t2 = clock.now()
        # An EOS that ends generation was still produced by this round: it counts towards acceptance.
        produced = len(plan.tokens) + (1 if plan.finish is FinishReason.STOP else 0)
        stats.record(len(block), verdict.accepted, produced)
        if plan.tokens:
            history.extend(plan.tokens)
            generated += len(plan.tokens)
            yield TokensCommitted(tokens=plan.tokens)
        yield RoundFinished(
            index=index,
            source=block.source if len(block) else "none",
            cap=cap,
            drafted=len(block),
            accepted=verdict.accepted,
            committed=len(plan.tokens),
            draft_s=t1 - t0,
            verify_s=t2 - t1,
            depth=depth,
        )
        if source is not None:
            decision = policy.observe(len(block), verdict.accepted, t2 - t0, depth)
            if decision is not None:
                yield CapChanged(old=decision.old, new=decision.new, reason=decision.reason)
        index += 1
        finish = plan.finish
        if finish is None and halt is not None and halt():
            finish = FinishReason.STOP_SEQUENCE
    yield Finished(reason=finish, usage=usage())
