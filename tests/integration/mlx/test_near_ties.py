"""Lossless, made precise (issue 26 §5): in fp32 greedy speculative decoding equals plain decoding token for
token in every mode; in bf16 and fp16 every divergence from it is a near-tie of the target.

At the first token where a speculative greedy output (DSpark, DFlash, lookup) parts from plain decoding,
`tests/near_ties.py` re-runs the target twice: as plain decoding computed that position (one-token steps) and
as the speculative run did (its rounds replayed, then the verify at its width). Each re-run must choose what
its run chose (so the check reads the logits the runs really saw), the two tokens must be the top two of
both, their gap within the dtype's rounding bound at their magnitude, and no logit of the vocabulary may move
between the two forwards by more than the error the bound assumes (the derivation is in that module).

MLX's CPU kernels give a row the same bits at any width (measured: nothing diverges on the CPU in any dtype),
so "split-k" runs the same targets with `tests/fakes/wide_kernels.py`, whose wide forwards sum in another
order as accelerator GEMMs do; there bf16 and fp16 outputs do diverge, and the test requires that they did.
"mlx" is the real kernels: a pass on the CPU, and the real check on an accelerator. A target that commits a
draft it rejected (a bug) is caught: the divergence it makes is no near-tie.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.engine import decode
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.events import RoundFinished
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from mlx_dspark.domain.verification.outcome import Acceptance
from tests import near_ties
from tests.decoding import collect
from tests.fakes.clock import FakeClock
from tests.fakes.wide_kernels import split_when_wide
from tests.integration.drafters import helpers

GREEDY = SamplingParams()
MODES = ("dspark", "dflash", "lookup")
DTYPES = {"bf16": mx.bfloat16, "fp16": mx.float16, "fp32": mx.float32}
FAMILIES = (("qwen3", 2), ("llama", 1))
TRIALS = 6
TOKENS = 60
CAP = 4


def _prompts(seed: int) -> Iterator[list[int]]:
    rng = random.Random(seed)
    for _ in range(TRIALS):
        yield [rng.randrange(1, helpers.VOCAB) for _ in range(rng.randint(3, 12))]


def _rig(tmp: Path, family: str, seed: int, dtype: str, kernels: str) -> tuple[Any, dict[str, Any]]:
    """A tiny target in `dtype` and every mode's draft source (drafters written from the fp32 target)."""
    model = helpers.tiny_target(family, seed)
    sources = {
        "dspark": load_drafter("dspark", str(helpers.write_dspark(tmp / "dspark", model)), model, bits=0),
        "dflash": load_drafter("dflash", str(helpers.write_dflash(tmp / "dflash", variant="v2")), model, bits=0),
        "lookup": LookupDraftSource(block=CAP, min_n=1, max_n=3),
    }
    model.set_dtype(DTYPES[dtype])
    if kernels == "split-k":
        split_when_wide(model)
    return model, sources


def _run(target: Any, prompt: list[int], max_tokens: int, source: Any = None) -> tuple[list[int], list[RoundFinished]]:
    if source is not None and source.uses_features:
        target.configure_capture(source.target_layer_ids)
    target.reset()
    stop = StopRule(max_tokens=max_tokens)
    cap = FixedCap(CAP) if source is not None else None
    tokens, rounds, _ = collect(decode(target, prompt, GREEDY, stop, FakeClock(), source=source, cap_policy=cap))
    assert 1 + sum(r.committed for r in rounds) == len(tokens)  # the prefill's token, then the rounds'
    return tokens, rounds


def _check(model: Any, prompt: list[int], plain: list[int], spec: list[int], rounds: list[RoundFinished]) -> Any:
    """The near-tie reading of the first divergence (None when the outputs are equal)."""
    i = near_ties.first_divergence(plain, spec)
    if i is None:
        return None
    assert i < min(len(plain), len(spec)), "one output stopped early: not a choice between two tokens"
    width, row, history = near_ties.locate(rounds, i)
    context = prompt + plain[:i]
    return near_ties.near_tie(
        model, context, (plain[i], spec[i]), width, row=row, prompt_len=len(prompt), rounds=history
    )


def _assert_near_tie(tie: Any, where: str) -> None:
    assert tie.reproduced, f"{where}: the re-runs do not choose what the runs chose: {tie.describe()}"
    # Both tokens within rounding of the top in both forwards (the top two, or two of a closer cluster).
    assert tie.step.margin <= tie.step.bound and tie.verify.margin <= tie.verify.bound, f"{where}: {tie.describe()}"
    assert tie.step.gap <= tie.step.bound and tie.verify.gap <= tie.verify.bound, f"{where}: {tie.describe()}"
    assert tie.spread_ulps <= tie.error_ulps, f"{where}: the forwards differ beyond the error model: {tie.describe()}"


@pytest.mark.parametrize(("family", "seed"), FAMILIES)
def test_fp32_greedy_output_equals_plain_decoding_in_every_mode(tmp_path: Path, family: str, seed: int) -> None:
    model, sources = _rig(tmp_path, family, seed, "fp32", "mlx")
    target = MlxTargetModel(model)
    accepted = 0
    for prompt in _prompts(seed):
        plain, _ = _run(target, prompt, TOKENS)
        for mode in MODES:
            spec, rounds = _run(target, prompt, TOKENS, sources[mode])
            assert spec == plain, (mode, prompt)
            accepted += sum(r.accepted for r in rounds)
    assert accepted > 0  # multi-token rounds ran


@pytest.mark.parametrize("kernels", ["mlx", "split-k"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_every_divergence_in_half_precision_is_a_near_tie(tmp_path: Path, dtype: str, kernels: str) -> None:
    checked: list[Any] = []
    for family, seed in FAMILIES:
        model, sources = _rig(tmp_path / family, family, seed, dtype, kernels)
        target = MlxTargetModel(model)
        for prompt in _prompts(seed):
            plain, _ = _run(target, prompt, TOKENS)
            for mode in MODES:
                spec, rounds = _run(target, prompt, TOKENS, sources[mode])
                tie = _check(model, prompt, plain, spec, rounds)
                if tie is not None:
                    _assert_near_tie(tie, f"{family} {mode} {prompt}")
                    checked.append(tie)
    if kernels == "split-k":  # the check ran on real divergences, so it could have failed
        assert checked, "no divergence: the test exercised nothing"
        assert any(t.width > 1 and t.row > 0 for t in checked)  # one inside a block of accepted drafts


class _CommitsARejectedDraft:
    """A target with a bug: when a verify rejects a draft, it reports that draft accepted too."""

    def __init__(self, inner: MlxTargetModel) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def verify(self, anchor: int, block: DraftBlock, *args: Any, **kwargs: Any) -> Acceptance:
        verdict = self._inner.verify(anchor, block, *args, **kwargs)
        if verdict.accepted < len(block):
            return Acceptance(accepted=verdict.accepted + 1, next_token=verdict.next_token)
        return verdict


def test_a_committed_rejected_draft_is_no_near_tie(tmp_path: Path) -> None:
    """The check can fail: the divergence such a bug makes is outside the bound even in bf16 with split-k."""
    model, sources = _rig(tmp_path, "qwen3", 2, "bf16", "split-k")
    target = MlxTargetModel(model)
    caught = 0
    for prompt in _prompts(2):
        plain, _ = _run(target, prompt, TOKENS)
        spec, rounds = _run(_CommitsARejectedDraft(target), prompt, TOKENS, sources["dflash"])
        tie = _check(model, prompt, plain, spec, rounds)
        assert tie is not None
        assert not tie.reproduced and not tie.holds, tie.describe()
        caught += 1
    assert caught == TRIALS


def test_first_divergence_and_locate() -> None:
    assert near_ties.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert near_ties.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert near_ties.first_divergence([1, 2, 3], [1, 2]) == 2
    rounds = [
        RoundFinished(
            index=k, source="s", cap=4, drafted=d, accepted=c - 1, committed=c, draft_s=0, verify_s=0, depth=0
        )
        for k, (d, c) in enumerate([(4, 2), (0, 1), (4, 5)])
    ]
    # tokens: 0 = prefill; 1-2 round 0 (width 5); 3 round 1 (width 1); 4-8 round 2 (width 5)
    assert near_ties.locate(rounds, 1) == (5, 0, ())
    assert near_ties.locate(rounds, 2) == (5, 1, ())
    assert near_ties.locate(rounds, 3) == (1, 0, ((5, 2),))
    assert near_ties.locate(rounds, 8) == (5, 4, ((5, 2), (1, 1)))
    with pytest.raises(ValueError, match="prefill"):
        near_ties.locate(rounds, 0)
    with pytest.raises(ValueError, match="past"):
        near_ties.locate(rounds, 9)


def test_the_bound_is_the_dtype_grid_at_the_logits_magnitude() -> None:
    # bf16 steps 0.0625 on [8, 16) and 0.125 on [16, 32) (the runbook's measured near-ties sit there).
    assert near_ties.ulp(mx.bfloat16, 8.0) == near_ties.ulp(mx.bfloat16, 15.9) == 0.0625
    assert near_ties.ulp(mx.bfloat16, -26.0) == 0.125
    assert near_ties.ulp(mx.float16, 20.0) == 2.0**-6
    assert near_ties.ulp(mx.float32, 1.0) == 2.0**-23
    assert near_ties.rounding_bound(mx.bfloat16, 20.0, 30) == pytest.approx(2 * (1 + 30**0.5) * 0.125)
    assert near_ties.rounding_bound(mx.bfloat16, 20.0, 6) < 1.0  # a gap of whole logits is never "numerics"


@pytest.mark.slow
def test_the_default_model_in_bf16(tmp_path: Path) -> None:
    """The real default model (its loader keeps the stored dtype, float32 here; cast to bf16), on both kernels."""
    from mlx_dspark.application import bootstrap
    from mlx_dspark.application.settings import load_settings

    services = bootstrap.build(load_settings({}, environ={}))
    loaded = services.loader.load_target("default")
    sources = {mode: services.loader.load_drafter(mode, None, loaded, bits=0) for mode in MODES}
    model = loaded.handle
    model.set_dtype(mx.bfloat16)
    target = loaded.target
    prompt = list(loaded.tokenizer.encode("Write a short story about a lighthouse keeper who finds a bottle."))
    checked = []
    for kernels in ("mlx", "split-k"):
        if kernels == "split-k":
            split_when_wide(model)
            target = MlxTargetModel(model)  # a compiled verify (accelerators) traced the unsplit kernels
        plain, _ = _run(target, prompt, 40)
        for mode in MODES:
            spec, rounds = _run(target, prompt, 40, sources[mode])
            tie = _check(model, prompt, plain, spec, rounds)
            if tie is not None:
                _assert_near_tie(tie, f"default {kernels} {mode}")
                checked.append(tie)
    assert checked
