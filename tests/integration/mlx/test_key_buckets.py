"""Key buckets (adapters/mlx/key_buckets.py): wide forwards attend over whole 256-row buffers under a mask.

On the CPU "auto" leaves them off, so these tests switch them on: the padded attention must give the exact
forward's logits (float32 rounding apart), take the padded path only where its own mask was built, keep its
buffers in whole buckets, move saved states between cache kinds, and leave greedy decoding with every drafter
equal to plain decoding.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

from mlx_dspark.adapters.mlx import batched_target, cache_state, compiled_forward, key_buckets
from mlx_dspark.adapters.mlx import caches as cache_ops
from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.drafters.backbone import ContextCache, DraftAttention
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.engine import decode
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests.decoding import collect
from tests.fakes.clock import FakeClock
from tests.fakes.tiny_models import FAMILIES, tiny_model
from tests.integration.drafters import helpers

GREEDY = SamplingParams()


@pytest.fixture
def buckets_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(key_buckets.ENV, "on")
    monkeypatch.setenv(compiled_forward.ENV, "off")  # the eager padded paths (test_compiled_forward.py: compiled)


@pytest.fixture
def key_lengths(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """(query rows, key rows) of every attention over a target cache or a drafter's context cache."""
    seen: list[tuple[int, int]] = []
    update = key_buckets.BucketedKVCache.update_and_fetch
    attend = DraftAttention._attend

    def target_side(self: Any, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out = update(self, keys, values)
        seen.append((int(keys.shape[2]), int(out[0].shape[2])))
        return out

    def drafter_side(self: Any, q: mx.array, k: mx.array, v: mx.array, context: Any, mask: Any) -> mx.array:
        seen.append((int(q.shape[2]), int(k.shape[2]) + (0 if context is None else int(context[0].shape[2]))))
        return attend(self, q, k, v, context, mask)

    monkeypatch.setattr(key_buckets.BucketedKVCache, "update_and_fetch", target_side)
    monkeypatch.setattr(DraftAttention, "_attend", drafter_side)
    yield seen


def test_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(key_buckets.ENV, "on")
    assert key_buckets.enabled()
    monkeypatch.setenv(key_buckets.ENV, "OFF")
    assert not key_buckets.enabled()
    monkeypatch.setenv(key_buckets.ENV, "auto")
    assert key_buckets.enabled() == (mx.default_device().type == mx.gpu and mx.cuda.is_available())
    monkeypatch.setenv(key_buckets.ENV, "sometimes")
    with pytest.raises(ValueError, match="MLX_DSPARK_KEY_BUCKETS must be auto, on or off"):
        key_buckets.enabled()


def test_capacity_is_whole_buckets() -> None:
    assert [key_buckets.capacity(n) for n in (1, 255, 256, 257, 700)] == [256, 256, 256, 512, 768]


def test_the_mask_is_causal_over_written_rows_and_hides_the_rest() -> None:
    n, offset, width = 5, 9, 256
    seen = key_buckets.visible(n, offset, width, None)
    assert seen.shape == (n, width)
    assert mx.array_equal(seen[:, : offset + n], create_causal_mask(n, offset)).item()
    assert not seen[:, offset + n :].any().item()
    additive = key_buckets.visible(n, offset, width, mx.float32)
    assert mx.array_equal(additive == 0, seen).item()
    assert (additive[:, offset + n :] == -mx.inf).all().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_verify_gives_the_exact_logits(family: str, key_lengths: list[tuple[int, int]]) -> None:
    model = tiny_model(family, seed=0)
    prompt = mx.array([list(range(3, 60))])
    block = mx.array([[5, 6, 7, 8, 9, 10, 11, 12]])
    logits = {}
    for buckets in (False, True):
        caches = cache_ops.make_caches(model, buckets=buckets)
        mx.eval(model(prompt, cache=caches))
        key_lengths.clear()
        logits[buckets] = model(block, cache=caches)
        mx.eval(logits[buckets])
        dense = sum(isinstance(c, key_buckets.BucketedKVCache) for c in caches)
        assert dense or not buckets
        assert key_lengths == [(8, 256)] * dense, (family, key_lengths)
        key_buckets.disarm()
    assert mx.allclose(logits[True], logits[False], atol=1e-5, rtol=1e-5).item()
    assert mx.array_equal(logits[True].argmax(-1), logits[False].argmax(-1)).item()


def test_only_a_forward_whose_mask_it_built_is_padded() -> None:
    cache = key_buckets.BucketedKVCache()
    rows = mx.ones((1, 2, 40, 4))
    keys, _ = cache.update_and_fetch(rows, rows)  # a prefill chunk: exact rows, buffer in whole buckets
    assert keys.shape[2] == 40 and cache.keys.shape[2] == 256
    wide = mx.ones((1, 2, 8, 4))
    key_buckets.disarm()
    keys, _ = cache.update_and_fetch(wide, wide)  # no mask from make_mask (a model passing "causal")
    assert keys.shape[2] == 48
    mask = cache.make_mask(8)
    assert mask.shape == (8, 256)
    keys, _ = cache.update_and_fetch(wide, wide)  # the forward the mask was built for
    assert keys.shape[2] == 256
    cache.make_mask(8)
    keys, _ = cache.update_and_fetch(mx.ones((1, 2, 4, 4)), mx.ones((1, 2, 4, 4)))  # not its width
    assert keys.shape[2] == 60
    cache.make_mask(1)
    keys, _ = cache.update_and_fetch(mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)))  # one-row steps stay exact
    assert keys.shape[2] == 61
    key_buckets.disarm()


def test_the_buffer_grows_and_stays_in_whole_buckets() -> None:
    cache = key_buckets.BucketedKVCache()
    for n in (100, 150, 10, 3):
        rows = mx.random.normal((1, 2, n, 4))
        cache.update_and_fetch(rows, rows)
    assert cache.offset == 263 and cache.keys.shape[2] == 512
    before = cache.keys[..., :263, :]
    cache.trim(20)
    cache.update_and_fetch(mx.zeros((1, 2, 300, 4)), mx.zeros((1, 2, 300, 4)))
    assert cache.offset == 543 and cache.keys.shape[2] == 768
    assert mx.array_equal(cache.keys[..., :243, :], before[..., :243, :]).item()


def test_saved_states_move_between_cache_kinds() -> None:
    model = tiny_model("qwen3", seed=0)
    prompt = mx.array([list(range(3, 40))])
    plain = cache_ops.make_caches(model)
    bucketed = cache_ops.make_caches(model, buckets=True)
    for caches in (plain, bucketed):
        mx.eval(model(prompt, cache=caches))
    tokens = tuple(range(3, 40))
    for source, kinds in ((plain, bucketed), (bucketed, plain)):
        state = cache_state.save(source, tag="t", tokens=tokens, features=None)
        fresh = cache_ops.make_caches(model, buckets=isinstance(kinds[0], key_buckets.BucketedKVCache))
        assert cache_state.load(state, fresh, keep=30)
        assert all(c.offset == 30 for c in fresh)
        assert type(fresh[0]) is type(kinds[0])
    assert cache_state.kind(bucketed[0]) == cache_state.kind(KVCache()) == "KVCache"


def run(model: Any, prompt: list[int], stop: StopRule, source: Any = None, cap: int = 7) -> list[int]:
    target = MlxTargetModel(model)
    if source is not None:
        target.configure_capture(source.target_layer_ids)
    tokens, _, _ = collect(decode(target, prompt, GREEDY, stop, FakeClock(), source=source, cap_policy=FixedCap(cap)))
    return tokens


@pytest.mark.parametrize(
    ("kind", "opts"),
    [("dspark", {"packaging": "deepspec"}), ("dflash", {"variant": "v2"}), ("dflash", {"variant": "sliding"})],
    ids=["dspark", "dflash", "dflash-sliding"],
)
def test_greedy_decoding_with_buckets_equals_plain_decoding(
    tmp_path: Path, buckets_on: None, key_lengths: list[tuple[int, int]], kind: str, opts: dict[str, Any]
) -> None:
    model = helpers.tiny_target("qwen3", seed=2)

    def padded() -> None:
        # Both the verify and the drafter's block attended over whole buckets (plus the block's own rows).
        assert any(q > 1 and k == 256 for q, k in key_lengths), key_lengths
        assert any(q > 1 and k == 256 + q for q, k in key_lengths), key_lengths

    source = tiny_source(tmp_path, model, kind, opts)
    assert_decodes_as_plain(model, source, seed=3, seen=key_lengths, check=padded)


def tiny_source(tmp: Path, model: Any, kind: str, opts: dict[str, Any]) -> Any:
    """A tiny DSpark or DFlash source for `model` (a DFlash "sliding" variant gets a 6-row window)."""
    if kind == "dflash":
        extra = {"sliding_window": 6} if opts.get("variant") == "sliding" else {}
        path = helpers.write_dflash(tmp / kind, **opts, **extra)
    else:
        path = helpers.write_dspark(tmp / kind, model, **opts)
    return load_drafter(kind, str(path), model, bits=0)


def assert_decodes_as_plain(
    model: Any, source: Any, *, seed: int, seen: list[Any] | None = None, check: Any = None
) -> None:
    """Greedy decoding with `source` equals plain decoding on four random prompts and budgets; `seen` is
    emptied before each speculative run and `check()` called after it."""
    rng = random.Random(seed)
    for _ in range(4):
        prompt = [rng.randrange(120) for _ in range(rng.randint(2, 30))]
        stop = StopRule(max_tokens=rng.randint(8, 40))
        expected = run(model, prompt, stop)
        if seen is not None:
            seen.clear()
        assert run(model, prompt, stop, source=source) == expected, prompt
        if check is not None:
            check()


@pytest.mark.parametrize("sliding", [None, 6])
def test_a_drafter_block_over_padded_context_gives_the_exact_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sliding: int | None
) -> None:
    extra = {} if sliding is None else {"sliding_window": sliding}
    path = helpers.write_dflash(tmp_path / "d", variant="sliding" if sliding else "v2", **extra)
    model = helpers.tiny_target("qwen3", seed=2)
    backbone = load_drafter("dflash", str(path), model, bits=0).drafter
    cfg = backbone.config
    features = mx.random.normal((40, len(cfg.target_layer_ids) * cfg.target_hidden_size), key=mx.random.key(1))
    block = mx.random.normal((1, cfg.block_size, cfg.hidden_size), key=mx.random.key(2))
    hidden = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(key_buckets.ENV, mode)
        monkeypatch.setenv(compiled_forward.ENV, "off")
        cache = ContextCache(backbone)
        cache.append(features[:25], 0)
        cache.append(features[25:], 25)  # two appends: rows written at an offset inside the buffer
        hidden[mode] = cache.forward(block, 40)
        rows = ContextCache.forward_rows([cache, cache], mx.concatenate([block, block]), [40, 40])
        assert mx.allclose(rows[0], hidden[mode][0], atol=1e-5).item()
    assert mx.allclose(hidden["on"], hidden["off"], atol=1e-5, rtol=1e-5).item()


@pytest.mark.parametrize("kind", ["dspark", "lookup"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_batched_rows_with_buckets_equal_solo_decoding(
    monkeypatch: pytest.MonkeyPatch, buckets_on: None, kind: str, sampled: bool
) -> None:
    from tests.integration.mlx import test_batching_speculative as rig

    widths: list[tuple[int, int, int]] = []  # (rows written, key rows attended, buffer rows) per batched layer
    update = batched_target._HoleCache.update_and_fetch

    def spy(self: Any, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out = update(self, keys, values)
        widths.append((int(keys.shape[2]), int(out[0].shape[2]), int(self.keys.shape[2])))
        return out

    monkeypatch.setattr(batched_target._HoleCache, "update_and_fetch", spy)
    reqs = rig.requests(3, sampled=sampled, seed=70 + sampled)
    jobs = [rig.Job(r) for r in reqs]
    scheduler = rig.run_batched(rig.service(kind), jobs, join_every=2)
    assert scheduler.widest > 1
    for job, req in zip(jobs, reqs, strict=True):
        rig.assert_like_solo(job, rig.solo(kind, req))
    # Every batched forward (plain ticks and verifies) attended over its whole buffer, whose length changes only
    # when rows join or leave (merge, filter) or it grows a bucket: not with every forward, as exact rows would.
    assert widths and all(attended == buffer for _, attended, buffer in widths)
    shapes = {buffer for _, _, buffer in widths}
    assert len(shapes) * 5 <= len(widths), (shapes, len(widths))
    assert any(rows > 1 for rows, _, _ in widths)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_with_buckets_as_mlx_lm_does(buckets_on: None, family: str) -> None:
    # The rollback suite (right, partly wrong and random drafts; sliding windows, recurrent state) with every
    # verify padded: the greedy output is still mlx-lm's own.
    from tests.integration.mlx import test_target_greedy as suite

    suite.test_speculative_equals_plain_and_mlx_lm(family)
