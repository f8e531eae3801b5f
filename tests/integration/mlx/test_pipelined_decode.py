"""The pipelined plain path: a step queued ahead (before the host reads the current token) never shows.

Closing the decode generator while a step is queued, an EOS or a budget end after one, and a drafter's
round after plain steps must all leave the cache holding exactly the committed rows: the next request,
reusing that prefix, produces what a fresh target produces. Plain and snapshot caches (sliding window,
gated DeltaNet) both.
"""

from __future__ import annotations

import functools
import random

import pytest

from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.engine import decode
from mlx_dspark.domain.drafting.block import EMPTY_BLOCK
from mlx_dspark.domain.events import TokensCommitted
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.fakes.clock import FakeClock
from tests.fakes.tiny_models import FAMILIES, tiny_model

PROMPT = [3, 17, 99, 5, 42, 7, 1, 150]
SAMPLINGS = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.9, top_p=0.95, seed=7)}


@functools.cache
def model(family: str):
    return tiny_model(family, seed=0)


def tokens(target: MlxTargetModel, prompt: list[int], sampling: SamplingParams, n: int, reuse: int = 0) -> list[int]:
    out: list[int] = []
    for ev in decode(target, prompt, sampling, StopRule(max_tokens=n), FakeClock(), reuse_prefix=reuse):
        if isinstance(ev, TokensCommitted):
            out.extend(ev.tokens)
    return out


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_closing_mid_pipeline_leaves_the_cache_exact(family: str, sampling: str) -> None:
    params = SAMPLINGS[sampling]
    target = MlxTargetModel(model(family))
    events = decode(target, PROMPT, params, StopRule(max_tokens=30), FakeClock())
    got: list[int] = []
    for ev in events:
        if isinstance(ev, TokensCommitted):
            got.extend(ev.tokens)
            if len(got) >= 6:
                break
    assert target.step_queued, "the test must close the loop while a step is queued"
    events.close()
    assert target.cached_tokens == len(PROMPT) + len(got) - 1  # the queued row is not counted

    # The next request extends the committed history and reuses its cached rows.
    follow = [*PROMPT, *got, 11, 12]
    reused = tokens(target, follow, params, 12, reuse=len(PROMPT) + len(got))
    assert target.cached_tokens == len(follow) + len(reused) - 1
    assert reused == tokens(MlxTargetModel(model(family)), follow, params, 12)


@pytest.mark.parametrize("family", FAMILIES)
def test_pipelined_plain_decoding_equals_unpipelined(family: str) -> None:
    """Same uniforms in the same order: the queued path and a step-by-step target agree token for token."""
    params = SAMPLINGS["sampled"]
    target = MlxTargetModel(model(family))
    piped = tokens(target, PROMPT, params, 24)
    stepwise: list[int] = []
    plain = MlxTargetModel(model(family))
    # The port without `ahead`: one synchronous verify per token, uniforms drawn as the loop draws them.
    rng = random.Random(params.seed)
    history = list(PROMPT)
    first = plain.prefill(PROMPT, params, rng.random())
    stepwise.append(first)
    history.append(first)
    while len(stepwise) < 24:
        verdict = plain.verify(history[-1], EMPTY_BLOCK, params, [rng.random()])
        plain.commit(1)
        stepwise.append(verdict.next_token)
        history.append(verdict.next_token)
    assert piped == stepwise
    assert target.cached_tokens == plain.cached_tokens == len(PROMPT) + 23
