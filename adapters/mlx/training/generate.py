"""Batched response generation by the target (the training labels are the target's own outputs).

A lock-step loop over one batched KV cache: every step feeds one token per row through the target, one
vectorised sampler picks the next token of every row (per-row temperature and top-p as arrays; temperature
0 is greedy), and finished rows are refilled with the next prompts. The next step is queued with
`async_eval` before the host reads the current tokens, so the device never waits on the host.

Rows never share positions: each row keeps its own position counter (RoPE offset) and writes its key/value
at that index of its own cache row; the mask lets a row see only indices up to its own position. New
prompts are prefilled right-padded from index 0, so no query row is ever fully masked and no row attends to
a padding or stale key (`tests/integration/training/test_generate.py` poisons every unwritten slot and pins
exactness against single-sequence greedy decoding, EOS and refills included).

Why drafters trained on an earlier left-padded lock-step loop's CUDA output did not transfer was checked on
an H200 (MLX 0.32.4): that loop was exact in float32 there too (8/8 rows equal single-sequence greedy, no NaN
in padded keys), so padding was not it; the cause was not reproduced. The measured suspect is precision: in
bfloat16, batched rows match single-sequence greedy less often (this loop 11/16, the old one 5/8), and bf16
greedy decoding of SmolLM2-135M leaves float32 greedy within 48 tokens on 8 of 16 held-out prompts, so bf16
data is partly another model's. Measured since, it did not limit the shipped drafters: their acceptance on
the float32 CPU target matched the bf16 teacher-forced estimate (1.85 against 1.80), so both slots generated
in bf16 for speed; generate in float32 where a drafter beats that estimate on its float32 target.

mlx-lm's `BatchGenerator` with per-sequence samplers ran at ~200-870 tok/s on an H200. This loop, with the
host's per-step work vectorised (a Python loop over rows cost as much as the forward at B = 1024) and prompts
started in length order within windows, ran at 40.1k / 46.4k tok/s at B = 1024 / 2048 (bf16, half the rows
sampled at T 0.7, no nucleus cut, short prompts) and 30.9k tok/s over the real mixed set (mean prompt 117
tokens, up to 640), where refill prefills cost most; the sort of a nucleus cut roughly halves the sampler.
On Qwen2.5-Coder-1.5B (H100, B 2048, 384 keys; `scripts/gen_profile.py`) a step's forward took 88.5 ms, the
sampler 12 ms more and the nucleus sort over all rows 44 ms more: only the rows of prompts that cut a nucleus
are sorted now (their own lanes of the batch).

Targets whose caches the lock-step rows cannot hold (recurrent or convolutional layers: Qwen3-Next, LFM2,
Nemotron-H; sliding windows: Gemma) generate one prompt at a time on mlx-lm's own caches (`generate_each`), with
the same sampler: slower, exact for every family.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_dspark.adapters.mlx import model_parts

BUCKET = 64  # attention spans grow in steps of this many keys (few distinct shapes to compile)


class _Rows:
    """Per-row state shared by every layer's cache: positions (device) and the attended span."""

    def __init__(self, pos: mx.array, span: int, prefill: bool) -> None:
        self.pos = pos
        self.span = span
        self.prefill = prefill


class RowCache:
    """A KV cache of B independent rows for mlx-lm attention layers (llama-style `update_and_fetch`).

    Decode (one token per row) writes row b's key/value at index pos[b]; prefill writes [0, N) of every row.
    `offset` is each row's position (RoPE), `make_mask` hides every index past a row's own position.
    """

    def __init__(self, rows: _Rows, capacity: int) -> None:
        self.rows = rows
        self.capacity = capacity
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        return self.rows.pos

    def _alloc(self, like_k: mx.array, like_v: mx.array, batch: int) -> None:
        h, dk, dv = like_k.shape[1], like_k.shape[3], like_v.shape[3]
        self.keys = mx.zeros((batch, h, self.capacity, dk), like_k.dtype)
        self.values = mx.zeros((batch, h, self.capacity, dv), like_v.dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None or self.values is None:
            self._alloc(keys, values, keys.shape[0])
        assert self.keys is not None and self.values is not None
        n = keys.shape[2]
        if self.rows.prefill:
            self.keys[:, :, :n, :] = keys
            self.values[:, :, :n, :] = values
            return self.keys[:, :, :n, :], self.values[:, :, :n, :]
        idx = self.rows.pos.astype(mx.int32)[:, None, None, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(idx, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(idx, values.shape), values, axis=2)
        span = self.rows.span
        return self.keys[:, :, :span, :], self.values[:, :, :span, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if window_size is not None:
            raise NotImplementedError("sliding-window targets are not supported by the lock-step generator")
        if self.rows.prefill:
            return "causal" if n > 1 else None
        keys = mx.arange(self.rows.span)[None, :]
        return (keys <= self.rows.pos[:, None])[:, None, None, :]

    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]


def sample_rows(logits: mx.array, temps: mx.array, top_ps: mx.array, key: mx.array, *, nucleus: bool) -> mx.array:
    """One token per row: argmax where temps == 0, else a sample of softmax(logits / T) cut to top-p.

    The nucleus keeps every token whose mass strictly above it is < top_p (the domain's rule); `nucleus`
    False skips the sort when no row cuts.
    """
    logits = logits.astype(mx.float32)
    greedy = mx.argmax(logits, axis=-1)
    scaled = logits / mx.maximum(temps, 1e-6)[:, None]
    if nucleus:
        order = mx.argsort(-scaled, axis=-1)
        ranked = mx.take_along_axis(scaled, order, axis=-1)
        probs = mx.softmax(ranked, axis=-1)
        above = mx.cumsum(probs, axis=-1) - probs
        ranked = mx.where(above < top_ps[:, None], ranked, -mx.inf)
        choice = mx.random.categorical(ranked, key=key)
        sampled = mx.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    else:
        sampled = mx.random.categorical(scaled, key=key)
    return mx.where(temps > 0, sampled, greedy).astype(mx.int32)


def _decoder_caches(model: nn.Module, rows: _Rows, capacity: int) -> list[RowCache]:
    return [RowCache(rows, capacity) for _ in range(model_parts.num_layers(model))]


def _last_logits(model: nn.Module, ids: mx.array, lengths: mx.array, caches: list[RowCache]) -> mx.array:
    """Logits at each row's last real token (rows right-padded); only those rows go through the head."""
    hidden = model_parts._decoder(model)(ids, cache=caches)
    last = mx.take_along_axis(hidden, (lengths - 1)[:, None, None].astype(mx.int32), axis=1)[:, 0, :]
    return model_parts.lm_head(model, last)


def _step_logits(model: nn.Module, tokens: mx.array, caches: list[RowCache]) -> mx.array:
    hidden = model_parts._decoder(model)(tokens[:, None], cache=caches)
    return model_parts.lm_head(model, hidden[:, 0, :])


def lock_step_fits(model: nn.Module) -> bool:
    """Whether every layer's cache is a plain KV cache, which the lock-step rows replace (`RowCache`)."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def generate_each(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    eos_ids: Sequence[int],
    max_new_tokens: int,
    temperatures: Sequence[float],
    top_p: float | Sequence[float] = 1.0,
    seed: int,
    deadline: float | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> list[list[int] | None]:
    """`generate_responses` one prompt at a time on the model's own mlx-lm caches: any family."""
    n = len(prompts)
    out: list[list[int] | None] = [None] * n
    tops = [float(top_p)] * n if isinstance(top_p, (int, float)) else [float(x) for x in top_p]
    eos = {int(t) for t in eos_ids}
    key = mx.random.key(seed)
    produced = 0
    for i, prompt in enumerate(prompts):
        if deadline is not None and time.monotonic() > deadline:
            break
        temp = mx.array([float(temperatures[i])], dtype=mx.float32)
        top = mx.array([tops[i]], dtype=mx.float32)
        nucleus = tops[i] < 1.0 and temperatures[i] > 0
        cache = make_prompt_cache(model)
        logits = model(mx.array([list(prompt)]), cache=cache)[:, -1]
        response: list[int] = []
        while len(response) < max_new_tokens:
            key, sub = mx.random.split(key)
            token = int(sample_rows(logits, temp, top, sub, nucleus=nucleus).item())
            response.append(token)  # the EOS token too: the drafter learns to stop
            if token in eos:
                break
            logits = model(mx.array([[token]]), cache=cache)[:, -1]
        out[i] = response
        produced += len(response)
        if progress is not None and ((i + 1) % 256 == 0 or i + 1 == n):
            progress(i + 1, n, produced)
    return out


def generate_responses(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    eos_ids: Sequence[int],
    max_new_tokens: int,
    batch: int,
    temperatures: Sequence[float],
    top_p: float | Sequence[float] = 1.0,
    seed: int,
    deadline: float | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    refill_min: int | None = None,
) -> list[list[int] | None]:
    """Responses of the target to `prompts` (ending with the EOS token when it stopped on one).

    Args:
        model: the mlx-lm target (any family: one whose layers are not all plain KV attention runs
            `generate_each`).
        prompts: prompt token ids (chat template already applied).
        eos_ids: tokens that end a response.
        max_new_tokens: response cap.
        batch: rows decoded together.
        temperatures: one per prompt (0 = greedy).
        top_p: nucleus cut, one for all or one per prompt.
        seed: seed of the sampled rows' random draws.
        deadline: `time.monotonic()` after which no new prompt is started (unfinished ones are dropped).
        progress: called with (finished, total, generated tokens).
        refill_min: free rows that trigger a refill prefill (default: an eighth of the batch).

    Returns:
        One response per prompt, None where the deadline left it unfinished.
    """
    n = len(prompts)
    out: list[list[int] | None] = [None] * n
    if n == 0:
        return out
    if not lock_step_fits(model):
        return generate_each(
            model, prompts, eos_ids=eos_ids, max_new_tokens=max_new_tokens, temperatures=temperatures,
            top_p=top_p, seed=seed, deadline=deadline, progress=progress,
        )  # fmt: skip
    tops = [float(top_p)] * n if isinstance(top_p, (int, float)) else [float(x) for x in top_p]
    batch = max(1, min(batch, n))
    longest = max(len(p) for p in prompts)
    capacity = -(-(longest + max_new_tokens + 1) // BUCKET) * BUCKET
    eos = np.array(sorted({int(t) for t in eos_ids}) or [-1], dtype=np.int64)
    refill_min = max(1, refill_min or batch // 8)
    nucleus = any(t < 1.0 for t, temp in zip(tops, temperatures, strict=True) if temp > 0)
    key = mx.random.key(seed)

    # The nucleus sort is the sampler's dearest part (a [B, vocabulary] argsort a step), and only sampled prompts
    # with top-p < 1 need it: they decode in rows [0, lanes), every other prompt in [lanes, batch), so a step
    # sorts only the first `lanes` rows. Each lane draws from its own queue.
    cuts = np.array([t > 0 and p < 1.0 for t, p in zip(temperatures, tops, strict=True)])
    share = float(cuts.mean())
    lanes = 0 if share == 0 else batch if share == 1 else min(batch - 1, max(1, round(batch * share)))
    rows = _Rows(mx.zeros((batch,), dtype=mx.int32), BUCKET, prefill=False)
    caches = _decoder_caches(model, rows, capacity)
    pos = np.zeros(batch, dtype=np.int64)  # host copy: the position the next fed token is written at
    owner = np.full(batch, -1, dtype=np.int64)  # prompt index per row, -1 = free
    made = np.zeros(batch, dtype=np.int64)
    temps_h = np.zeros(batch, dtype=np.float32)
    tops_h = np.ones(batch, dtype=np.float32)
    written = np.zeros((batch, max_new_tokens), dtype=np.int32)  # each row's response so far
    done, produced = 0, 0
    temps_d, tops_d = mx.array(temps_h), mx.array(tops_h)
    # Prompts start in length order within windows of a few batches: a refill's prompts are padded to its
    # longest, and one long prompt among short ones made most of a refill's prefill padding.
    window = 8 * batch
    lengths = np.array([len(p) for p in prompts])
    order = np.concatenate([w + np.argsort(lengths[w : w + window], kind="stable") for w in range(0, n, window)])
    queues = [order[cuts[order]], order[~cuts[order]]] if 0 < lanes < batch else [order]
    heads = [0] * len(queues)  # the next prompt of each queue

    def fillable(free: np.ndarray) -> list[np.ndarray]:
        """`free` split by lane (the rows of each queue), each cut to the prompts its queue has left."""
        parts = [free[free < lanes], free[free >= lanes]] if len(queues) == 2 else [free]
        return [part[: len(q) - h] for part, q, h in zip(parts, queues, heads, strict=True)]

    def refill(parts: list[np.ndarray], tokens: mx.array) -> mx.array:
        """Prefill the next prompts into the rows of `parts` (`fillable`'s lanes); returns `tokens` with their
        first tokens set."""
        nonlocal key, temps_d, tops_d
        take = []
        for lane, part in enumerate(parts):
            take += [int(i) for i in queues[lane][heads[lane] : heads[lane] + len(part)]]
            heads[lane] += len(part)
        if not take:
            return tokens
        free = np.concatenate(parts)
        lens = [len(prompts[i]) for i in take]
        width = -(-max(lens) // BUCKET) * BUCKET
        ids = np.zeros((len(take), width), dtype=np.int32)
        for j, i in enumerate(take):
            ids[j, : lens[j]] = prompts[i]
        pre_rows = _Rows(mx.zeros((len(take),), dtype=mx.int32), width, prefill=True)
        pre = _decoder_caches(model, pre_rows, width)
        logits = _last_logits(model, mx.array(ids), mx.array(lens), pre)
        t = mx.array([float(temperatures[i]) for i in take], dtype=mx.float32)
        p = mx.array([tops[i] for i in take], dtype=mx.float32)
        key, sub = mx.random.split(key)
        first = sample_rows(logits, t, p, sub, nucleus=nucleus)
        where = mx.array(free.astype(np.int32))
        for c, fresh in zip(caches, pre, strict=True):
            assert fresh.keys is not None and fresh.values is not None
            if c.keys is None or c.values is None:
                c._alloc(fresh.keys, fresh.values, batch)
            assert c.keys is not None and c.values is not None
            c.keys[where, :, :width, :] = fresh.keys
            c.values[where, :, :width, :] = fresh.values
        owner[free] = take
        made[free] = 0
        pos[free] = lens
        temps_h[free] = [float(temperatures[i]) for i in take]
        tops_h[free] = [tops[i] for i in take]
        temps_d, tops_d = mx.array(temps_h), mx.array(tops_h)
        tokens[where] = first
        return tokens

    tokens = refill(fillable(np.arange(batch)), mx.zeros((batch,), dtype=mx.int32))
    mx.eval(tokens, *[a for c in caches for a in c.state])
    while True:
        active = owner >= 0
        if not active.any():
            break
        # Queue the step that feeds `tokens` at `pos`, then read `tokens` on the host meanwhile.
        rows.pos = mx.array(np.where(active, pos, 0).astype(np.int32))
        rows.span = min(capacity, -(-(int(pos[active].max()) + 1) // BUCKET) * BUCKET)
        logits = _step_logits(model, tokens, caches)
        key, sub = mx.random.split(key)
        if len(queues) == 2:
            first, second = mx.random.split(sub)
            following = mx.concatenate(
                [
                    sample_rows(logits[:lanes], temps_d[:lanes], tops_d[:lanes], first, nucleus=True),
                    sample_rows(logits[lanes:], temps_d[lanes:], tops_d[lanes:], second, nucleus=False),
                ]
            )
        else:
            following = sample_rows(logits, temps_d, tops_d, sub, nucleus=nucleus)
        mx.async_eval(following, *[a for c in caches for a in c.state])
        # The host's share of a step is a few vectorised array ops (a Python loop over B rows per step
        # cost as much as the forward at B = 1024); only finished rows are touched one by one.
        fed = np.asarray(tokens)
        act = np.flatnonzero(active)
        written[act, made[act]] = fed[act]  # the EOS token too: the drafter learns to stop
        made[act] += 1
        pos[act] += 1
        produced += len(act)
        finished = act[(made[act] >= max_new_tokens) | np.isin(fed[act], eos)]
        for r in finished:
            out[int(owner[r])] = written[r, : made[r]].tolist()
            done += 1
            if progress is not None and done % 256 == 0:
                progress(done, n, produced)
        owner[finished] = -1
        tokens = following
        free = np.flatnonzero(owner < 0)
        # The step just queued wrote junk for freed rows at their old positions: harmless, a refill
        # overwrites the row from index 0 and the mask hides everything past the new position.
        out_of_time = deadline is not None and time.monotonic() > deadline
        if out_of_time:
            heads = [len(q) for q in queues]  # start nothing new; finish the rows in flight
        parts = fillable(free)
        ready = sum(len(part) for part in parts)
        if ready and (ready >= refill_min or len(free) == batch):
            tokens = refill(parts, tokens)
    if progress is not None:
        progress(done, n, produced)
    return out
