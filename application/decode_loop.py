"""The one decode loop every mode runs: prefill, then rounds of draft → verify → accept → commit/rollback.

Plain decoding is this loop with no draft source (cap 0), so budget, stop and sampling rules are the
same in every mode by construction. Its speed comes from the target: when the next round is known to be
another plain step, the loop hands over that step's uniform (`ahead`) so the target can queue it before
the host reads the current token. Uniforms are drawn in the same order either way. A selection may carry a
SourceSwitcher (auto mode): after each round it may hand over to another source; the target verifies every
round, so a switch never changes output.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator, Sequence
from typing import Any

from mlx_dspark.application.prefill import prefill
from mlx_dspark.domain.budget import plan_commit, round_cap
from mlx_dspark.domain.costmodel.acceptance import AcceptanceStats
from mlx_dspark.domain.costmodel.draft_cap import CapPolicy, FixedCap
from mlx_dspark.domain.drafting.block import EMPTY_BLOCK, DraftContext
from mlx_dspark.domain.drafting.selection import PLAIN, Selection
from mlx_dspark.domain.errors import ContextTooLong, InvalidRequest
from mlx_dspark.domain.events import CapChanged, DecodeEvent, Finished, RoundFinished, TokensCommitted, Usage
from mlx_dspark.domain.ports import Clock, DraftSource, TargetModel
from mlx_dspark.domain.tokens import FinishReason, SamplingParams, StopRule


def _policy(selection: Selection) -> CapPolicy:
    if selection.source is None:
        return FixedCap(0)
    return selection.policy or FixedCap(selection.source.max_block)


class _Features:
    """Target features taken this request, so a feature-reading source that switches back in catches up.

    `take_features` hands each row out once; while another feature reader runs, the rows it takes are
    kept here (opaque handles, in order) and replayed to a returning source before its next draft.
    """

    def __init__(self, target: TargetModel, keep: bool) -> None:
        self._target = target
        self._keep = keep
        self._chunks: list[tuple[int, Any]] = []  # (position the rows end at, features)
        self._read: dict[int, int] = {}  # id(source) -> chunks it has seen

    def for_round(self, source: DraftSource, position: int, history: Sequence[int], sampling: SamplingParams) -> Any:
        if self._keep:
            for end, rows in self._chunks[self._read.get(id(source), 0) :]:
                ctx = DraftContext(anchor=history[end], position=end, history=history[: end + 1], features=rows)
                source.propose(ctx, 0, sampling, ())  # cap 0: only takes the rows in
        features = self._target.take_features()
        if self._keep:
            self._chunks.append((position, features))
            self._read[id(source)] = len(self._chunks)
        return features


def decode(
    target: TargetModel,
    prompt: Sequence[int],
    sampling: SamplingParams,
    stop: StopRule,
    clock: Clock,
    *,
    source: DraftSource | None = None,
    cap_policy: CapPolicy | None = None,
    selection: Selection | None = None,
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
        selection: instead of `source` and `cap_policy`: a selector's choice, whose `switcher` (if any) may
            move the request to another source between rounds.
        reuse_prefix: leading prompt tokens whose rows are already in the target's cache.
        context_window: the target's context length, enforced before every round.
        halt: asked after each commit's events; True ends the request as STOP_SEQUENCE (the caller saw a
            stop string), with this round's real accounting in Finished.
        snapshots: prompt lengths at which `on_snapshot` saves the target's state during prefill.
        on_snapshot: called when the cache holds exactly a snapshot point's rows.

    Yields:
        PrefillProgress (long prompts), TokensCommitted, RoundFinished, CapChanged and SourceSwitched
        events, then exactly one Finished.
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
    current = selection or Selection(
        name=source.name if source is not None else PLAIN, source=source, policy=cap_policy
    )
    switcher = current.switcher
    policy = _policy(current)
    begun: set[int] = set()
    if current.source is not None:
        current.source.begin(prompt)
        begun.add(id(current.source))
    features = _Features(target, keep=switcher is not None)
    # A switcher may move the request to a feature drafter later: capture from the start then.
    wants_features = switcher is not None or (current.source is not None and current.source.uses_features)
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
            source=current.name,
        )

    index = 0
    queued: float | None = None  # the uniform of a plain step the target may already have queued
    round_start = decode_start
    while finish is None:
        src = current.source
        depth = target.cached_tokens
        if context_window is not None and depth + 1 >= context_window:
            finish = FinishReason.CONTEXT
            break
        requested = policy.cap(depth) if src is not None else 0
        cap = round_cap(requested, stop.max_tokens - generated)
        if context_window is not None:
            cap = max(0, min(cap, context_window - depth - 2))
        anchor = history[-1]
        t0 = clock.now()
        block = EMPTY_BLOCK
        if src is not None and cap > 0:
            feats = features.for_round(src, depth, history, sampling) if src.uses_features else None
            ctx = DraftContext(anchor=anchor, position=depth, history=history, features=feats)
            cap = min(cap, src.max_block)
            block = src.propose(ctx, cap, sampling, [rng.random() for _ in range(cap)])
            block = block.truncated(cap)
        t1 = clock.now()
        if len(block):
            uniforms = [rng.random() for _ in range(len(block) + 1)]
        else:
            uniforms = [queued if queued is not None else rng.random()]
        queued = None
        # Plain mode: the next round is another plain step unless this one ends the request.
        if src is None and generated + 1 < stop.max_tokens and (
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
        if src is not None:
            decision = policy.observe(len(block), verdict.accepted, t2 - t0, depth)
            if decision is not None:
                yield CapChanged(old=decision.old, new=decision.new, reason=decision.reason)
        index += 1
        finish = plan.finish
        if finish is None and halt is not None and halt():
            finish = FinishReason.STOP_SEQUENCE
        if switcher is not None:
            # Wall time per round, the caller's share included: what the request really gets. The last
            # round is reported too (what it measured outlives the request); a move after it is void.
            now = clock.now()
            nxt = switcher.after_round(current.name, produced, now - round_start, drafted=len(block), depth=depth)
            round_start = now
            if finish is None and nxt is not None and nxt.name != current.name:
                current, policy = nxt, _policy(nxt)
                if current.source is not None and id(current.source) not in begun:
                    current.source.begin(prompt)
                    begun.add(id(current.source))
                if nxt.switched is not None:
                    yield nxt.switched
    yield Finished(reason=finish, usage=usage())
