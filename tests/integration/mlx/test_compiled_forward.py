"""The compiled verify forward (adapters/mlx/compiled_forward.py) against the eager one it replaces.

On the CPU both are off by default, so these tests switch key buckets and compilation on: a compiled verify
must give the eager bucketed verify's verdicts and features bit for bit, be traced once per shape and replayed
after, leave the caches as the eager forward does (rollback, plain steps and saved states keep working), stay
out of targets that are not dense KV, and keep greedy decoding with a drafter equal to plain decoding.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlx_dspark.adapters.mlx import compiled_forward, key_buckets
from mlx_dspark.adapters.mlx.compiled_forward import CompiledForward
from mlx_dspark.adapters.mlx.drafters import load_drafter
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.tokens import SamplingParams
from tests.fakes.tiny_models import FAMILIES, tiny_model

GREEDY = SamplingParams()
DENSE = ("llama", "qwen3", "qwen3_moe", "minicpm", "qwen3_ternary", "bitnet")


def target(monkeypatch: pytest.MonkeyPatch, family: str, compiled: bool) -> MlxTargetModel:
    monkeypatch.setenv(key_buckets.ENV, "on")
    monkeypatch.setenv(compiled_forward.ENV, "on" if compiled else "off")
    return MlxTargetModel(tiny_model(family, seed=0), capture_layers=(-1, 0, 1))


def rounds(t: MlxTargetModel, seed: int) -> list[tuple[int, int, list[float]]]:
    """Verdicts and committed features over 12 rounds of random drafts (partly accepted, rolled back)."""
    rng = random.Random(seed)
    anchor = t.prefill([rng.randrange(100) for _ in range(rng.randint(3, 40))], GREEDY, 0.5)
    t.take_features()
    out = []
    for _ in range(12):
        drafts = tuple(rng.randrange(100) for _ in range(rng.randint(1, 9)))
        verdict = t.verify(anchor, DraftBlock(tokens=drafts), GREEDY, [0.5] * (len(drafts) + 1))
        keep = rng.randint(0, verdict.accepted) + 1
        t.commit(keep)
        features = t.take_features()
        assert features is not None
        out.append((verdict.accepted, verdict.next_token, features.reshape(-1).tolist()))
        anchor = verdict.next_token if keep == verdict.accepted + 1 else drafts[keep - 1]
    return out


def test_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [("on", True, True), ("on", False, False), ("off", True, False)]
    cases += [("auto", True, True), ("auto", False, False)]
    for mode, buckets, want in cases:
        monkeypatch.setenv(compiled_forward.ENV, mode)
        assert compiled_forward.enabled(buckets) is want
    monkeypatch.setenv(compiled_forward.ENV, "always")
    with pytest.raises(ValueError, match="MLX_DSPARK_COMPILE must be auto, on or off"):
        compiled_forward.enabled(True)
    # Plain steps: auto compiles them on the CPU only; MLX_DSPARK_COMPILE=off turns every compiled forward off.
    on_cpu = mx.default_device().type == mx.cpu
    for everything, steps, want in [("auto", "auto", on_cpu), ("auto", "on", True), ("on", "off", False)]:
        monkeypatch.setenv(compiled_forward.ENV, everything)
        monkeypatch.setenv(compiled_forward.STEPS_ENV, steps)
        assert compiled_forward.steps_enabled() is want
    monkeypatch.setenv(compiled_forward.ENV, "off")
    monkeypatch.setenv(compiled_forward.STEPS_ENV, "on")
    assert not compiled_forward.steps_enabled()
    monkeypatch.setenv(compiled_forward.ENV, "auto")
    monkeypatch.setenv(compiled_forward.STEPS_ENV, "yes")
    with pytest.raises(ValueError, match="MLX_DSPARK_COMPILE_STEPS must be auto, on or off"):
        compiled_forward.steps_enabled()


@pytest.mark.parametrize("family", DENSE)
def test_compiled_verifies_equal_the_eager_ones(monkeypatch: pytest.MonkeyPatch, calls: list[int], family: str) -> None:
    for seed in range(3):
        eager = rounds(target(monkeypatch, family, compiled=False), seed)
        assert not calls
        t = target(monkeypatch, family, compiled=True)
        assert rounds(t, seed) == eager  # verdicts and every feature row, bit for bit
        assert calls and all(n > 1 for n in calls)
        assert t._compiled is not None
        # Traced once per recorded layer set (its graph cache keys); replays follow for every round.
        assert len(t._compiled._graphs) == 1 and len(calls) == 12
        calls.clear()


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(DENSE)))
def test_targets_that_are_not_dense_kv_stay_eager(
    monkeypatch: pytest.MonkeyPatch, calls: list[int], family: str
) -> None:
    t = target(monkeypatch, family, compiled=True)
    eager = rounds(target(monkeypatch, family, compiled=False), 1)
    assert rounds(t, 1) == eager
    assert not calls


def test_the_buffer_grows_inside_a_compiled_round(monkeypatch: pytest.MonkeyPatch, calls: list[int]) -> None:
    # Rows that cross a bucket's end: the compiled path grows the buffers first, as the eager cache does.
    t = target(monkeypatch, "qwen3", compiled=True)
    e = target(monkeypatch, "qwen3", compiled=False)
    prompt = list(range(3, 99)) * 2 + list(range(3, 63))  # 252 rows: the next verify crosses 256
    verdicts = []
    for x in (t, e):
        anchor = x.prefill(prompt, GREEDY, 0.5)
        verdicts.append(x.verify(anchor, DraftBlock(tokens=(1, 2, 3, 4, 5, 6, 7)), GREEDY, [0.5] * 8))
        x.commit(8)
    assert verdicts[0] == verdicts[1]
    assert calls == [8]
    assert t._caches[0].keys.shape[2] == e._caches[0].keys.shape[2] == 512
    assert t.cached_tokens == e.cached_tokens
    want = e.take_features()
    got = t.take_features()
    assert want is not None and got is not None and mx.array_equal(got, want).item()


@pytest.mark.parametrize(
    ("kind", "opts"), [("dspark", {"packaging": "deepspec"}), ("dflash", {"variant": "v2"})], ids=["dspark", "dflash"]
)
def test_greedy_decoding_with_a_drafter_equals_plain_decoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, calls: list[int], kind: str, opts: dict[str, Any]
) -> None:
    from tests.integration.drafters import helpers
    from tests.integration.mlx.test_key_buckets import assert_decodes_as_plain, tiny_source

    monkeypatch.setenv(key_buckets.ENV, "on")
    monkeypatch.setenv(compiled_forward.ENV, "on")
    model = helpers.tiny_target("qwen3", seed=2)
    assert_decodes_as_plain(model, tiny_source(tmp_path, model, kind, opts), seed=5)
    assert any(n > 1 for n in calls)  # the verifies
    assert 1 in calls  # and the plain steps both runs take


@pytest.mark.parametrize(
    ("family", "sampling", "buckets"),
    [("llama", GREEDY, "off"), ("qwen3", SamplingParams(temperature=0.8), "off"), ("qwen3", GREEDY, "on")],
)
def test_compiled_plain_steps_equal_the_eager_ones(
    monkeypatch: pytest.MonkeyPatch, calls: list[int], family: str, sampling: SamplingParams, buckets: str
) -> None:
    # Plain steps (one row, each queued from the previous step's token on the device) run the compiled graph
    # too: the same tokens as eager steps across a bucket's end (prompt 250 + 30), the same features within
    # float32 rounding (the compiled step attends over the padded buffer, masked, as a compiled verify does).
    out = []
    for compiled in (False, True):
        monkeypatch.setenv(key_buckets.ENV, buckets)  # the plain KV cache, or the key-bucketed one
        monkeypatch.setenv(compiled_forward.ENV, "auto" if compiled else "off")
        t = MlxTargetModel(tiny_model(family, seed=0), capture_layers=(-1, 0, 1))
        assert t._compile_steps is compiled  # the CPU's default
        rng = random.Random(3)
        token = t.prefill([rng.randrange(100) for _ in range(250)], sampling, 0.5)
        t.take_features()
        tokens, features = [token], []
        uniforms = [rng.random() for _ in range(31)]
        for i in range(30):
            # The step queued ahead is used when its uniform is the next step's, dropped (cut) every 7th step.
            ahead = uniforms[i + 1] if i % 7 else 0.123
            verdict = t.verify(tokens[-1], DraftBlock(), sampling, [uniforms[i]], ahead=ahead if i < 29 else None)
            t.commit(1)
            tokens.append(verdict.next_token)
            got = t.take_features()
            assert got is not None
            features.append(got.reshape(-1))
        out.append((tokens, mx.stack(features), t.cached_tokens))
    assert out[1][0] == out[0][0] and out[1][2] == out[0][2]
    assert mx.allclose(out[1][1], out[0][1], rtol=1e-4, atol=1e-5).item()
    assert calls and set(calls) == {1}  # the compiled run's steps, none of the eager run's
    # 29 steps queued ahead, and 6 run when none could be used: the first, and the 5 after a dropped one.
    assert len(calls) == 29 + 6


def test_cpu_verifies_compile_while_their_attention_is_small(monkeypatch: pytest.MonkeyPatch, calls: list[int]) -> None:
    # Without key buckets (the CPU's default) verifies compile with the plain steps, over the plain cache, as long as
    # rows x padded keys stays below the NumPy attention's share (eager forwards hand that to `cpu_kernels`); the
    # verdicts are the eager ones, the features equal within float32 rounding.
    if mx.default_device().type != mx.cpu:
        pytest.skip("the CPU's policy")
    monkeypatch.setenv(key_buckets.ENV, "off")
    out = {}
    for mode in ("off", "auto"):
        monkeypatch.setenv(compiled_forward.ENV, mode)
        t = MlxTargetModel(tiny_model("qwen3", seed=0), capture_layers=(-1, 0, 1))
        assert t._compile_verifies is (mode == "auto")
        if mode == "auto":
            t._verify_scores = 4 * 256  # a verify of 4 or more rows over a 256-row buffer stays eager
        out[mode] = rounds(t, 4)
    for (a_on, n_on, f_on), (a_off, n_off, f_off) in zip(out["auto"], out["off"], strict=True):
        assert (a_on, n_on) == (a_off, n_off)
        assert mx.allclose(mx.array(f_on), mx.array(f_off), rtol=1e-4, atol=1e-5).item()
    assert calls and all(n < 4 for n in calls)  # compiled: the narrow verifies only
    assert any(n > 1 for n in calls)


@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_a_compiled_markov_chain_drafts_what_the_eager_one_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threshold: float
) -> None:
    from tests.integration.drafters import helpers

    model = helpers.tiny_target("qwen3", seed=2)
    path = helpers.write_dspark(tmp_path / "dspark", model)
    h = mx.random.normal((3, 4, helpers.HIDDEN), key=mx.random.key(4))
    anchors = mx.array([5, 17, 99], dtype=mx.int32)
    out = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(key_buckets.ENV, mode)
        monkeypatch.setenv(compiled_forward.ENV, mode)
        source = load_drafter("dspark", str(path), model, bits=0, confidence_threshold=threshold)
        hidden = h.astype(source.drafter.dtype)
        rows = [source._chain(hidden[i], anchors[i], GREEDY, None) for i in range(3)]
        batched = source.greedy_slots(hidden, anchors)
        assert bool(source._chains) == (mode == "on")  # traced per shape: one row, and the batch of three
        assert len(source._chains) == (2 if mode == "on" else 0)
        out[mode] = (
            [r[0].tolist() for r in rows],
            batched[0].tolist(),
            None if batched[1] is None else batched[1].tolist(),
        )
    assert out["on"] == out["off"]


@pytest.mark.parametrize(("kind", "sliding"), [("dspark", None), ("dflash", None), ("dflash", 6)])
def test_a_compiled_draft_block_equals_the_eager_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, sliding: int | None
) -> None:
    from tests.integration.drafters import helpers

    model = helpers.tiny_target("qwen3", seed=2)
    if kind == "dflash":
        extra = {} if sliding is None else {"sliding_window": sliding}
        path = helpers.write_dflash(tmp_path / kind, variant="sliding" if sliding else "v2", **extra)
    else:
        path = helpers.write_dspark(tmp_path / kind, model)
    hidden = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(key_buckets.ENV, "on")
        monkeypatch.setenv(compiled_forward.ENV, mode)
        source = load_drafter(kind, str(path), model, bits=0)
        cfg = source.drafter.config
        features = mx.random.normal((40, len(cfg.target_layer_ids) * cfg.target_hidden_size), key=mx.random.key(1))
        twin = source.fork()
        rows = []
        for cache in (source.cache, twin.cache):
            cache.append(features[:25], 0)
            cache.append(features[25:], 25)
            rows.append(cache.block_hidden(source.block_ids(7), 40))
            cache.append(features[:3], 40)  # the next round: three more rows, the same bucket
            rows.append(cache.block_hidden(source.block_ids(9), 43))
        hidden[mode] = rows
        # Compiled once per (bucket, block) and shared by the fork; a sliding drafter stays eager.
        assert len(source._graphs) == (1 if mode == "on" and sliding is None else 0)
    for got, want in zip(hidden["on"], hidden["off"], strict=True):
        assert mx.array_equal(got, want).item()


def test_a_model_that_cannot_be_traced_verifies_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def untraceable(self: Any, tokens: mx.array, caches: Any, layers: Any) -> Any:
        raise NotImplementedError("no trace here")

    eager = rounds(target(monkeypatch, "qwen3", compiled=False), 2)
    t = target(monkeypatch, "qwen3", compiled=True)
    monkeypatch.setattr(CompiledForward, "__call__", untraceable)
    with pytest.warns(RuntimeWarning, match="compiled verify off for this model: NotImplementedError"):
        assert rounds(t, 2) == eager
    assert t._compiled is None
