"""Lab tool (issue 26 §5): is a greedy divergence from plain decoding a near-tie of the target, or a bug?

`first_divergence` finds where a speculative greedy output parts from plain decoding; `near_tie` re-runs the
target at that context twice, as plain decoding computes the position (a one-token step) and as the
speculative round did (one verify forward `width` rows wide), and reports, for each, whether the two tokens
are the target's top two and how far apart their logits are, against `rounding_bound`. Never on the serving
path: it needs only mlx, numpy and attrs, so the device bench can import it on a bare host (repo root on
`sys.path`).

Why a bound in ulps. A logit z is stored in the model's dtype, on a grid whose spacing at |z| is
ulp(|z|) = 2^(floor(log2 |z|) - p), p the dtype's fraction bits (7 for bf16, 10 for fp16, 23 for fp32: bf16
steps 0.0625 on [8, 16) and 0.125 on [16, 32)); its unit roundoff u = 2^-(p+1) satisfies u |z| < ulp(|z|).
A one-row and a `width`-row forward do the same arithmetic in different accumulation orders (GEMM tiles,
split-K, attention blocks chosen by shape), so any value either one stores may land on the neighbouring grid
point of the other's. For one logit that gives |z_a - z_b| <= e, with e made of
  * 1 ulp(|z|): the logit's own rounding (two values a hair apart can round to adjacent points);
  * what the final hidden state h brings. Each of the L layers adds its own roundings to the residual stream,
    relative u per value; independent ones add like a random walk, about sqrt(L) u |h| after L layers. The
    head reads that as w.dh, about |w| sqrt(L) u |h| / sqrt(H) for a deviation in no particular direction
    (H = hidden size), while a leading logit is at least |w| |h| / sqrt(H) (one standard deviation of the
    logits; the top of a vocabulary sits several above). So w.dh <= sqrt(L) u |z| < sqrt(L) ulp(|z|).
So e = (1 + sqrt(L)) ulp(|z|) (`logit_error_ulps`). Two forwards pick different tokens of x, y only if
gap_a + gap_b = (z_a(x) - z_b(x)) - (z_a(y) - z_b(y)) <= 2e, so the gap in either is at most
  bound = 2 (1 + sqrt(L)) ulp(max(|z_x|, |z_y|))      (`rounding_bound`),
6.9 ulps on the 6-layer test targets (0.43 at logits of 8-16 in bf16) and 13 ulps on the 30-layer default
model (0.81 there, 1.6 at 16-32). It is a model of the error, not a worst case (one through 30 nonlinear
layers is far looser), so `near_tie` also measures `spread_ulps`, the largest |z_a - z_b| over the whole
vocabulary in ulps (at the leading logits' magnitude, or a logit's own where larger), to set against e.
A bug (a stale cache row, a draft accepted that the target did not choose) shows as a token outside the
top two or a gap of whole logits, and the re-run of the speculative computation then does not choose the
speculative token (`reproduced`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

FRACTION_BITS = {mx.bfloat16: 7, mx.float16: 10, mx.float32: 23}
_SMALLEST_NORMAL = {mx.bfloat16: 2.0**-126, mx.float16: 2.0**-14, mx.float32: 2.0**-126}


def first_divergence(plain_ids: Sequence[int], spec_ids: Sequence[int]) -> int | None:
    """The first position where two greedy outputs differ, or where the shorter one ends; None if identical."""
    for i, (a, b) in enumerate(zip(plain_ids, spec_ids)):
        if a != b:
            return i
    return None if len(plain_ids) == len(spec_ids) else min(len(plain_ids), len(spec_ids))


def ulp(dtype: mx.Dtype, magnitude: float) -> float:
    """The spacing of `dtype`'s grid at `magnitude` (the spacing of the smallest normals below them)."""
    floor = _SMALLEST_NORMAL[dtype]
    m = max(abs(magnitude), floor)
    return 2.0 ** (math.floor(math.log2(m)) - FRACTION_BITS[dtype])


def logit_error_ulps(layers: int) -> float:
    """How far, in ulps at its magnitude, two accumulation orders may move one logit: 1 + sqrt(layers)."""
    return 1.0 + math.sqrt(layers)


def rounding_bound(dtype: mx.Dtype, magnitude: float, layers: int) -> float:
    """The largest gap between two logits of `magnitude` that different accumulation orders can flip:
    2 (1 + sqrt(layers)) ulps (the module docstring derives it)."""
    return 2.0 * logit_error_ulps(layers) * ulp(dtype, magnitude)


@attrs.frozen(kw_only=True)
class Reading:
    """What one forward says about the two tokens at the diverging position.

    Attributes:
        logits: the two tokens' logits (plain's, speculative's), as stored in the model's dtype.
        top: the forward's two highest-logit tokens, best first.
        in_top_two: no other token has a logit above the lower of the two.
        margin: the forward's highest logit minus the lower of the two (their gap when they are its top two). Where
            three or more tokens sit within rounding of each other (bf16 logits on one grid point), which two
            of them the runs pick is rounding too: a near-tie needs the two within the bound of the top, not
            the top two themselves.
        gap: |logits[0] - logits[1]|.
        ulp: the dtype's ulp at the larger magnitude of the two.
        bound: `rounding_bound` at that magnitude.
    """

    logits: tuple[float, float]
    top: tuple[int, int]
    in_top_two: bool
    margin: float
    gap: float
    ulp: float
    bound: float

    @property
    def near_tie(self) -> bool:
        return self.margin <= self.bound and self.gap <= self.bound


@attrs.frozen(kw_only=True)
class NearTie:
    """Both re-runs of one divergence.

    Attributes:
        tokens: (plain's token, speculative's token).
        dtype: the model's dtype, by name.
        width, row: the verify's width and the row of it that predicted the diverging position.
        step: the one-token step (the logits plain decoding saw).
        verify: the verify forward.
        layers: the model's decoder layers (the bound's depth).
        spread: max |step - verify| over the whole vocabulary (what the two forwards really differ by).
        spread_ulps: the same in ulps, each logit's difference over the ulp at the larger of its own magnitude
            and the two tokens' (the frame of the error the bound assumes).
    """

    tokens: tuple[int, int]
    dtype: str
    width: int
    row: int
    step: Reading
    verify: Reading
    layers: int
    spread: float
    spread_ulps: float

    @property
    def error_ulps(self) -> float:
        """The per-logit error the bound assumes (`logit_error_ulps`), to set `spread_ulps` against."""
        return logit_error_ulps(self.layers)

    @property
    def reproduced(self) -> bool:
        """Whether the step chose plain's token and the verify the speculative one, as the two runs did."""
        return self.step.top[0] == self.tokens[0] and self.verify.top[0] == self.tokens[1]

    @property
    def holds(self) -> bool:
        """Whether both forwards see the two tokens as their top two within the rounding bound."""
        return self.step.near_tie and self.verify.near_tie

    def describe(self) -> str:
        s, v = self.step, self.verify
        return (
            f"{self.dtype} tokens {self.tokens} width {self.width} row {self.row}: "
            f"step logits {s.logits} top {s.top} gap {s.gap:.4g} ({s.gap / s.ulp:.2f} ulp) margin {s.margin:.4g}; "
            f"verify logits {v.logits} top {v.top} gap {v.gap:.4g} ({v.gap / v.ulp:.2f} ulp) margin {v.margin:.4g}; "
            f"bound {s.bound:.4g}; spread {self.spread:.4g} ({self.spread_ulps:.2f} ulp)"
        )


def locate(rounds: Sequence[Any], index: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """Where generated token `index` came from in a speculative run: (width, row, history).

    Args:
        rounds: the run's rounds in order (`RoundFinished`s, or anything with `drafted` and `committed`);
            the first generated token is the prefill's, the rounds commit the rest.
        index: a generated token's position (≥ 1).

    Returns:
        The verify width of the round that chose it, the row of that verify that predicted it, and every
        earlier round as (width, rows committed), for `near_tie(rounds=...)`.

    Raises:
        ValueError: `index` is the prefill's token or past the rounds.
    """
    if index < 1:
        raise ValueError("the first token is the prefill's: no verify chose it")
    history: list[tuple[int, int]] = []
    position = 1
    for r in rounds:
        width, committed = int(r.drafted) + 1, int(r.committed)
        if index < position + committed:
            return width, index - position, tuple(history)
        history.append((width, committed))
        position += committed
    raise ValueError(f"token {index} is past the {position} tokens the rounds committed")


def near_tie(
    target: Any,
    context: Sequence[int],
    tokens: tuple[int, int],
    width: int,
    *,
    row: int = 0,
    prompt_len: int | None = None,
    rounds: Sequence[tuple[int, int]] | None = None,
    drafts: Sequence[int] = (),
    prefill_chunk: int | None = None,
) -> NearTie:
    """Re-run the target where a greedy output diverged and read the two tokens' logits twice.

    Each re-run starts from a fresh cache and prefills context[:prompt_len - 1] in chunks. (a) The step then
    feeds every later token one at a time and reads the last one's logits: plain decoding's own order, so
    these are the logits plain decoding saw. (b) The verify feeds the rows before the diverging round as the
    speculative run did when `rounds` is given (each round one forward of its width, the rows it did not keep
    dropped), else one token at a time like (a); then [anchor, accepted drafts..., drafts...] in one forward
    `width` rows wide, and reads row `row`. With `rounds` and the run's `prefill_chunk`, (b) is the verify the
    speculative run computed.

    Args:
        target: an mlx-lm model or a `MlxTargetModel` (its model is used; the adapter's state is untouched).
        context: the token ids before the diverging position (prompt + the outputs' common prefix).
        tokens: (plain decoding's token, the speculative token) at that position.
        width: rows of the speculative round's verify forward (1 + its drafts).
        row: which of them predicted the diverging position (= drafts accepted before it in that round).
        prompt_len: the prompt's length (default: every row before the round's anchor counts as prompt).
        rounds: the speculative run's earlier rounds as (width, rows committed) (see `locate`).
        drafts: the round's drafts after row `row` (default: the speculative token repeated; a causal forward's
            row does not read later rows, only the forward's width matters).
        prefill_chunk: prompt tokens per prefill forward (default: the target's choice for this device).

    Returns:
        Both readings, the bound and the spread.

    Raises:
        ValueError: a row outside the width, rounds that do not cover the context, or caches that cannot
            drop a round's rejected rows exactly.
    """
    from mlx_dspark.adapters.mlx import caches, cpu_kernels
    from mlx_dspark.adapters.mlx.target import MlxTargetModel, default_prefill_chunk

    model = target.model if isinstance(target, MlxTargetModel) else target
    if not 0 <= row < width:
        raise ValueError(f"row must be in [0, {width}), got {row}")
    start = len(context) - row - 1  # the round's anchor
    if start < 0:
        raise ValueError("the context must hold the round's anchor and accepted drafts")
    prompt = start if prompt_len is None else prompt_len
    if not 1 <= prompt <= start:  # the prefill's own token is never verified
        raise ValueError(f"prompt_len must be in [1, {start}], got {prompt_len}")
    if rounds is not None and prompt + sum(c for _, c in rounds) != start:
        raise ValueError("the rounds must commit every row between the prompt and the round's anchor")
    chunk = prefill_chunk or default_prefill_chunk()
    cpu_kernels.install(model)
    filler = list(drafts)[: width - row - 1]
    filler += [tokens[1]] * (width - row - 1 - len(filler))

    def forward(cache: list[Any], ids: Sequence[int]) -> mx.array:
        with cpu_kernels.active():
            out: mx.array = model(mx.array([list(ids)]), cache=cache)
        return out[0]

    def prefilled() -> list[Any]:
        cache = caches.make_caches(model)
        for i in range(0, prompt - 1, chunk):
            forward(cache, context[i : min(i + chunk, prompt - 1)])
            mx.eval(caches.cache_arrays(cache))
        return cache

    cache = prefilled()
    for t in context[prompt - 1 : -1]:
        forward(cache, [t])
    step = forward(cache, context[-1:])[-1]
    mx.eval(step)

    cache = prefilled()
    forward(cache, context[prompt - 1 : prompt])  # the prompt's last token: the prefill's own one-token step
    position = prompt
    for w, kept in rounds if rounds is not None else [(1, 1)] * (start - prompt):
        rows = list(context[position : position + kept])
        forward(cache, rows + [rows[-1]] * (w - kept))  # rejected rows: any tokens, they are dropped
        if w > kept:
            if not caches.can_cut(cache, w - kept):
                raise ValueError("these caches cannot drop a round's rejected rows exactly")
            caches.cut(cache, w - kept)
        mx.eval(caches.cache_arrays(cache))
        position += kept
    verify = forward(cache, list(context[start:]) + filler)[row]
    mx.eval(verify)
    dtype = step.dtype
    step_np = np.array(step.astype(mx.float32))
    verify_np = np.array(verify.astype(mx.float32))
    layers = len([layer for layer in model.layers if layer is not None])
    return NearTie(
        tokens=tokens,
        dtype=str(dtype).rsplit(".", 1)[-1],
        width=width,
        row=row,
        step=_reading(step_np, tokens, dtype, layers),
        verify=_reading(verify_np, tokens, dtype, layers),
        layers=layers,
        spread=float(np.max(np.abs(step_np - verify_np))),
        spread_ulps=_spread_ulps(step_np, verify_np, tokens, dtype),
    )


def _spread_ulps(a: np.ndarray, b: np.ndarray, tokens: tuple[int, int], dtype: mx.Dtype) -> float:
    """max |a - b| over the vocabulary, each in ulps at the larger of its own and the two tokens' magnitude: the
    hidden state's share of the error is one absolute size for every logit (in the leading logits' frame), the
    logit's own rounding is at its own magnitude."""
    lead = max(abs(float(x[t])) for x in (a, b) for t in tokens)
    magnitudes = np.maximum(np.maximum(np.abs(a), np.abs(b)), lead)
    return float(np.max(np.abs(a - b) / _ulps(dtype, magnitudes)))


def _ulps(dtype: mx.Dtype, magnitudes: np.ndarray) -> np.ndarray:
    m = np.maximum(magnitudes, _SMALLEST_NORMAL[dtype])
    spacing: np.ndarray = np.exp2(np.floor(np.log2(m)) - FRACTION_BITS[dtype])
    return spacing


def _reading(logits: np.ndarray, tokens: tuple[int, int], dtype: mx.Dtype, layers: int) -> Reading:
    x, y = (float(logits[t]) for t in tokens)
    others = np.delete(logits, list(set(tokens)))
    order = np.argsort(-logits, kind="stable")
    magnitude = max(abs(x), abs(y))
    return Reading(
        logits=(x, y),
        top=(int(order[0]), int(order[1])),
        in_top_two=bool(others.size == 0 or float(others.max()) <= min(x, y)),
        margin=float(logits.max()) - min(x, y),
        gap=abs(x - y),
        ulp=ulp(dtype, magnitude),
        bound=rounding_bound(dtype, magnitude, layers),
    )
