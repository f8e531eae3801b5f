"""MlxTargetModel: the TargetModel port over any mlx-lm model (prefill, verify, exact commit, features).

Hidden states are tapped per instance: each decoder layer of this model object gets a subclass of its own
class that records its output; nothing in mlx or mlx-lm is patched, and parameter names do not change.
The taps capture the union of the layers every loaded drafter asked for (`add_capture`); each drafter
reads its own columns (`feature_columns`), and a request that needs no features records none.

Plain decoding is pipelined: a verify of an empty block may queue the next step from its own on-device
token (`verify(..., ahead=u)`) before the host reads that token, as mlx-lm's `generate_step` does. The
queued step is invisible: it is used only by the verify it predicted, and dropped exactly otherwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx

from mlx_dspark.adapters.mlx import (
    cache_state,
    compiled_forward,
    cpu_kernels,
    forward_cost,
    fused_projections,
    key_buckets,
    row_products,
)
from mlx_dspark.adapters.mlx import caches as cache_ops
from mlx_dspark.adapters.mlx.acceptance import accept_block, as_q_rows, greedy_accept, pick_token
from mlx_dspark.adapters.mlx.compiled_forward import CompiledForward
from mlx_dspark.adapters.mlx.readback import DeviceTokens
from mlx_dspark.domain.costmodel.prefill import ForwardCost
from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.ports import RollbackKind
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.outcome import Acceptance

EMBEDDING_OUTPUT = -1  # capture id of the hidden state that enters decoder layer 0
_COMPACT_AFTER = 256  # feature chunks kept apart before the already-read ones are merged


class EnoughLayers(Exception):
    """Raised by a tap once the recorder's `stop_after` layer has run: the rest of the forward is not needed."""


class _Recorder:
    """Where tapped layers write the hidden states of one forward (only while `active`)."""

    def __init__(self) -> None:
        self.active = False
        self.wanted: frozenset[int] = frozenset()
        self.rows: dict[int, mx.array] = {}
        self.stop_after: int | None = None  # a layer index after which the forward ends (EnoughLayers)


class _TapHub:
    """Shared by the taps of one model: routes recordings to the target that runs the current forward."""

    def __init__(self) -> None:
        self.recorder = _Recorder()


class _LayerTap:
    """Attached to one decoder layer instance: records its input (layer 0 only) and output."""

    def __init__(self, hub: _TapHub, index: int) -> None:
        self.hub = hub
        self.index = index

    def record(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        rec = self.hub.recorder
        if not rec.active:
            return
        if self.index == 0 and EMBEDDING_OUTPUT in rec.wanted:
            first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, mx.array))
            rec.rows[EMBEDDING_OUTPUT] = first
        if self.index in rec.wanted:
            rec.rows[self.index] = out[0] if isinstance(out, tuple) else out
        if rec.stop_after == self.index:
            raise EnoughLayers


_TAPPED_CLASSES: dict[type, type] = {}


def install_taps(layers: Sequence[Any]) -> _TapHub:
    """Tap every decoder layer once per model (`layers`: the decoder's, None entries left out); targets and the
    trainer's feature capture sharing a model share the hub."""
    existing = getattr(layers[0], "_dspark_tap", None) if layers else None
    if isinstance(existing, _LayerTap):
        return existing.hub
    hub = _TapHub()
    for index, layer in enumerate(layers):
        layer.__class__ = _tapped_class(type(layer))
        layer._dspark_tap = _LayerTap(hub, index)
    return hub


def record_layers(layers: Sequence[Any], wanted: Sequence[int], stop_after: int | None) -> _Recorder:
    """Arm the taps of `layers` to record `wanted` outputs (-1: the embedding output) in a fresh recorder, ending
    the forward with EnoughLayers after layer `stop_after` (None: the whole forward); `disarm` undoes it."""
    hub = install_taps(layers)
    rec = _Recorder()
    rec.wanted, rec.active, rec.stop_after = frozenset(wanted), True, stop_after
    hub.recorder = rec
    return rec


def disarm(layers: Sequence[Any]) -> None:
    """The taps of `layers` record nothing again."""
    install_taps(layers).recorder = _Recorder()


def _tapped_class(cls: type) -> type:
    """A subclass of a decoder-layer class whose calls report to the instance's `_dspark_tap`."""
    if getattr(cls, "_dspark_tapped", False):
        return cls
    sub = _TAPPED_CLASSES.get(cls)
    if sub is None:
        original_call = cls.__call__

        def tapped_call(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original_call(self, *args, **kwargs)
            self._dspark_tap.record(args, kwargs, out)
            return out

        sub = type(
            cls.__name__, (cls,), {"__call__": tapped_call, "_dspark_tapped": True, "__module__": cls.__module__}
        )
        _TAPPED_CLASSES[cls] = sub
    return sub


def _model_arg(model: Any, name: str) -> int:
    """A config value of an mlx-lm model (`args.<name>`, also inside `text_config` or a language model)."""
    for holder in (model, getattr(model, "language_model", None)):
        args = getattr(holder, "args", None)
        if args is None:
            continue
        value = getattr(args, name, None)
        text_config = getattr(args, "text_config", None)
        if value is None and isinstance(text_config, dict):
            value = text_config.get(name)
        if value is not None:
            return int(value)
    raise ValueError(f"cannot find {name!r} in the model's config")


class _Pending:
    """The last verify, until its commit."""

    def __init__(self, tokens: list[int], checkpoint: cache_ops.Checkpoint | None, features: mx.array | None):
        self.tokens = tokens
        self.checkpoint = checkpoint
        self.features = features


class _Ahead:
    """A plain step queued from a token still on device: one cache row past the pending verify."""

    def __init__(
        self,
        token: mx.array,
        next_token: mx.array,
        uniform: float,
        sampling: SamplingParams,
        checkpoint: cache_ops.Checkpoint | None,
        features: mx.array | None,
    ) -> None:
        self.token = token  # its input (the previous verify's next token)
        self.next_token = next_token  # its output, queued with async_eval
        self.uniform = uniform
        self.sampling = sampling
        self.checkpoint = checkpoint
        self.features = features
        self.anchor: int | None = None  # the input token's value, once the host has read it


GPU_PREFILL_CHUNK = 2048  # H200, MLX CUDA, default model: 1.29-1.37x the prefill tok/s of 512 (mlx-lm's step)
CPU_PREFILL_CHUNK = 512


def default_prefill_chunk() -> int:
    """Prompt tokens per prefill forward on the default device: GPUs want wide forwards."""
    return CPU_PREFILL_CHUNK if cpu_kernels.on_cpu() else GPU_PREFILL_CHUNK


class MlxTargetModel:
    """The TargetModel port over an mlx-lm model, with exact rollback for every cache kind.

    One request at a time. Rows rejected by a verify are dropped by trimming where that is exact (plain
    and quantized KV, rotating KV whose window stays complete); otherwise the caches go back to a
    checkpoint taken before the verify and the kept rows are run again (recurrent layers, a rotating
    cache that would lose rows it still needs).
    """

    def __init__(
        self,
        model: Any,
        *,
        capture_layers: tuple[int, ...] = (),
        prefill_chunk: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        fuse: bool = True,
    ) -> None:
        """Wrap `model` (switched to eval mode) and tap its decoder layers.

        Args:
            model: an mlx-lm `Model`.
            capture_layers: decoder-layer outputs to capture (see `configure_capture`).
            prefill_chunk: prompt tokens per forward during prefill (bounds activation memory); None: the
                device's measured best (`default_prefill_chunk`).
            kv_bits: quantize plain KV caches to this many bits (None: full precision).
            kv_group_size: quantization group size for `kv_bits`.
            fuse: fuse sibling projections (`fused_projections`; it reads every weight, so not for a lazily
                loaded model a tensor-parallel rank shards next).
        """
        prefill_chunk = prefill_chunk or default_prefill_chunk()
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self._model = model
        model.eval()
        if fuse:
            fused_projections.install(model)  # before row products: the fused projections take their path
        cpu_kernels.install(model)
        row_products.install(model)  # few-row projections as matrix-vector products where that pays (CUDA)
        self._layers = [layer for layer in model.layers if layer is not None]
        self._hidden = _model_arg(model, "hidden_size")
        self._vocab = _model_arg(model, "vocab_size")
        self._prefill_chunk = prefill_chunk
        self._kv_bits = kv_bits
        self._kv_group_size = kv_group_size
        self._buckets = key_buckets.enabled()  # fixed per process: states move between the two cache kinds
        self._compile_steps = compiled_forward.steps_enabled()
        # Verifies compile over key buckets (CUDA), or on the CPU with its steps while their attention stays below
        # what the NumPy kernels take over in an eager forward (`cpu_kernels.MIN_SCORES` scores).
        cpu = cpu_kernels.on_cpu() and not self._buckets
        self._compile_verifies = compiled_forward.enabled(self._buckets) or (cpu and self._compile_steps)
        self._verify_scores = cpu_kernels.MIN_SCORES // _model_arg(model, "num_attention_heads") if cpu else None
        self._compiled = (
            CompiledForward(model, self._start_recording) if self._compile_verifies or self._compile_steps else None
        )
        self._recorder = _Recorder()
        self._hub = self._install_taps()
        self._capture: tuple[int, ...] = ()
        self._columns: dict[tuple[tuple[int, ...], tuple[int, ...]], mx.array] = {}
        self._recording = False  # whether this request records features (see reset)
        self._caches: list[Any] = []
        self._plain = True
        self._offset = 0
        self._ids: list[int] = []  # token ids of the cached rows, for prefix reuse
        self._pending: _Pending | None = None
        self._ahead: _Ahead | None = None
        self._feature_chunks: list[mx.array] = []
        self._feature_rows = 0  # leading cached rows whose features are in _feature_chunks
        self._features_read = 0  # chunks already handed out by take_features
        self._fresh()
        self.configure_capture(capture_layers)

    # Properties -----------------------------------------------------------------------------------

    @property
    def model(self) -> Any:
        """The wrapped mlx-lm module."""
        return self._model

    @property
    def hidden_size(self) -> int:
        return self._hidden

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self._capture

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def rollback_kind(self) -> RollbackKind:
        return RollbackKind.TRIM if self._plain else RollbackKind.SNAPSHOT

    @property
    def cached_tokens(self) -> int:
        return self._offset

    @property
    def cached_ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    @property
    def step_queued(self) -> bool:
        """Whether a plain step is queued ahead of the last verify (invisible until used or dropped)."""
        return self._ahead is not None

    # Configuration --------------------------------------------------------------------------------

    def configure_capture(self, layer_ids: tuple[int, ...]) -> None:
        """Capture exactly these layers' outputs from now on; a change starts from an empty cache.

        Args:
            layer_ids: 0-based decoder-layer indices, each meaning that layer's output (HF
                `hidden_states[i + 1]`); -1 is the embedding output. Features concatenate them in
                this order.
        """
        ids = tuple(int(i) for i in layer_ids)
        for i in ids:
            if not EMBEDDING_OUTPUT <= i < len(self._layers):
                raise ValueError(f"layer id {i} is outside [-1, {len(self._layers) - 1}]")
        if ids == self._capture:
            return
        self._capture = ids
        self._recorder.wanted = frozenset(ids)
        self._recording = bool(ids)
        self._fresh()

    def add_capture(self, layer_ids: Sequence[int]) -> None:
        """Also capture these layers (a drafter's taps), keeping every layer captured so far.

        Features keep the earlier layers' columns first; each drafter finds its own with
        `feature_columns`, so loading a second drafter never changes what the first one reads.
        """
        wanted = tuple(int(i) for i in layer_ids)
        union = self._capture + tuple(dict.fromkeys(i for i in wanted if i not in self._capture))
        self.configure_capture(union)

    def feature_columns(self, layer_ids: Sequence[int]) -> mx.array | None:
        """Column indices of `layer_ids` (in that order) in the features `take_features` returns.

        Returns:
            None when the features are exactly those layers, else an int32 index array for `take`.

        Raises:
            ValueError: a layer is not captured.
        """
        ids = tuple(int(i) for i in layer_ids)
        if ids == self._capture:
            return None
        missing = [i for i in ids if i not in self._capture]
        if missing:
            raise ValueError(f"layers {missing} are not captured (captured: {list(self._capture)})")
        key = (self._capture, ids)
        cols = self._columns.get(key)
        if cols is None:
            h = self._hidden
            starts = mx.array([self._capture.index(i) * h for i in ids], dtype=mx.int32)
            cols = (starts[:, None] + mx.arange(h, dtype=mx.int32)[None]).reshape(-1)
            self._columns[key] = cols
        return cols

    # The port -------------------------------------------------------------------------------------

    def reset(self, keep: int = 0, *, capture: bool = True) -> int:
        """Drop every cached row past the first `keep`; returns the rows really kept.

        Args:
            keep: leading rows to keep (prefix reuse).
            capture: whether this request reads features (a drafter that uses them). Without it
                nothing is recorded; with it, rows cached without features are not kept.
        """
        self._drop_ahead()
        if self._pending is not None:
            self.commit(0)
        self._recording = capture and bool(self._capture)
        keep = max(0, min(keep, self._offset))
        if self._recording:
            keep = min(keep, self._feature_rows)
        drop = self._offset - keep
        if keep > 0 and cache_ops.can_cut(self._caches, drop):
            cache_ops.cut(self._caches, drop)
            self._offset = keep
            del self._ids[keep:]
            self._keep_features(min(keep, self._feature_rows))
        else:
            self._fresh()
        return self._offset

    def forward_cost(self) -> ForwardCost:
        """The decoder layers' GEMM work per token (the prefill bench's limit)."""
        return forward_cost.forward_cost(self._layers)

    def gemm_flops_per_s(self) -> float:
        """This model's widest projection, timed at the prefill chunk's width, now."""
        return forward_cost.gemm_flops_per_s(self._layers, self._prefill_chunk)

    def prefill(self, tokens: Sequence[int], sampling: SamplingParams, uniform: float) -> int:
        """Append `tokens` to the cache in chunks and return the first argmax or sampled token."""
        if self._pending is not None:
            raise RuntimeError("prefill while a verify awaits its commit")
        self._drop_ahead()
        tokens = list(tokens)
        if not tokens:
            raise ValueError("prefill needs at least one token")
        body, last = tokens[:-1], tokens[-1]
        record = self._recording
        for start in range(0, len(body), self._prefill_chunk):
            piece = body[start : start + self._prefill_chunk]
            self._forward(mx.array(piece), record=record)
            features = self._recorded() if record else None
            # Evaluate chunk by chunk so activation memory stays bounded by the chunk size.
            mx.eval(cache_ops.cache_arrays(self._caches), [] if features is None else features)
            self._add_features(features)
        logits = self._forward(mx.array([last]), record=record)[0, -1]
        features = self._recorded() if record else None
        token = pick_token(logits, sampling, uniform)
        mx.eval(token, [] if features is None else features)
        self._add_features(features)
        self._offset += len(tokens)
        self._ids.extend(tokens)
        return int(cast(int, token.item()))

    def extend(self, tokens: Sequence[int]) -> None:
        """Append `tokens` to the cache in chunks; no logits are computed."""
        if self._pending is not None:
            raise RuntimeError("extend while a verify awaits its commit")
        self._drop_ahead()
        tokens = list(tokens)
        record = self._recording
        for start in range(0, len(tokens), self._prefill_chunk):
            piece = tokens[start : start + self._prefill_chunk]
            self._forward(mx.array(piece), record=record)
            features = self._recorded() if record else None
            # Evaluate chunk by chunk so activation memory stays bounded by the chunk size.
            mx.eval(cache_ops.cache_arrays(self._caches), [] if features is None else features)
            self._add_features(features)
        self._offset += len(tokens)
        self._ids.extend(tokens)

    @property
    def state_tag(self) -> str:
        capture = ",".join(str(i) for i in self._capture)
        return f"capture={capture};kv_bits={self._kv_bits}/{self._kv_group_size}"

    def save_state(self) -> cache_state.MlxCacheState:
        """The cached rows, features included, as a state later forwards never change (buffers shared)."""
        if self._pending is not None:
            raise RuntimeError("save_state while a verify awaits its commit")
        self._drop_ahead()
        features = None
        if self._capture:
            features = self._all_features()
            mx.eval(features)
            if self._features_read == len(self._feature_chunks):  # all read: keep one merged chunk
                self._feature_chunks = [features] if features.shape[0] else []
                self._features_read = len(self._feature_chunks)
        return cache_state.save(self._caches, tag=self.state_tag, tokens=tuple(self._ids), features=features)

    def load_state(self, state: Any, keep: int) -> int:
        """Replace the cache by `state` cut to `keep` rows; 0 (an empty cache) when that is not exact."""
        self._drop_ahead()
        if self._pending is not None:
            self.commit(0)
        fresh = self._make_caches()
        if (
            not isinstance(state, cache_state.MlxCacheState)
            or state.tag != self.state_tag
            or not 0 < keep <= state.length
            or not cache_state.load(state, fresh, keep)
        ):
            self._fresh()
            return 0
        self._caches = fresh
        self._offset = keep
        self._ids = list(state.tokens[:keep])
        self._feature_chunks = [state.features[:keep]] if state.features is not None else []
        self._feature_rows = min(keep, 0 if state.features is None else int(state.features.shape[0]))
        self._features_read = 0
        return keep

    def verify(
        self,
        anchor: int,
        block: DraftBlock,
        sampling: SamplingParams,
        uniforms: Sequence[float],
        *,
        ahead: float | None = None,
    ) -> Acceptance:
        """Run [anchor, drafts...] in one forward and decide acceptance on device (one host sync).

        Drafts still on the device (`DeviceTokens`) are read back with the verdict, in that one sync.

        Args:
            anchor: the last committed token.
            block: the drafts (empty for a plain step).
            sampling: the request's sampling.
            uniforms: len(block) + 1 uniforms.
            ahead: for a plain step, the uniform of the next plain step: that step is queued from
                this step's token before the host reads it, and used if the next verify is that step.
        """
        if self._pending is not None:
            raise RuntimeError("verify while the previous verify awaits its commit")
        if not len(block):
            return self._plain_step(anchor, sampling, uniforms[0] if uniforms else 0.5, ahead)
        self._drop_ahead()
        k = len(block)
        # Drafts still on the device go straight into the forward and come back with the verdict.
        on_device = block.pending if isinstance(block.pending, DeviceTokens) else None
        host = None if on_device is not None else list(block.tokens)
        if on_device is not None:
            drafts = on_device.array.astype(mx.int32)
        else:
            drafts = mx.array(host, dtype=mx.int32)
        checkpoint = None if self._plain else cache_ops.Checkpoint(self._caches)
        inputs = mx.concatenate([mx.array([anchor], dtype=mx.int32), drafts])
        logits = self._forward(inputs, record=self._recording, compiled=True)[0]
        features = self._recorded() if self._recording else None
        if sampling.greedy:
            verdict = greedy_accept(logits, drafts)
        else:
            verdict = accept_block(
                logits, drafts, as_q_rows(block.q, k), mx.array(list(uniforms[: k + 1]), dtype=mx.float32), sampling
            )
        out = verdict if on_device is None else mx.concatenate([verdict, drafts])
        mx.async_eval(out, *([] if features is None else [features]))
        values = cast(list[int], out.tolist())  # the round's one host sync
        if on_device is not None:
            on_device.known(tuple(values[2:]))
        ids = host if host is not None else values[2:]
        self._pending = _Pending([anchor, *ids], checkpoint, features)
        return Acceptance(accepted=values[0], next_token=values[1])

    def commit(self, keep_rows: int) -> None:
        """Keep the first `keep_rows` rows of the last verify, exactly undoing the rest."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("commit without a verify")
        width = len(pending.tokens)
        if not 0 <= keep_rows <= width:
            raise ValueError(f"keep_rows must be in [0, {width}], got {keep_rows}")
        drop = width - keep_rows
        if drop:
            self._drop_ahead()  # its row sits on top of the rows being dropped
        if drop and cache_ops.can_cut(self._caches, drop):
            cache_ops.cut(self._caches, drop)
        elif drop:
            self._rewind(pending, width)
            if keep_rows:
                self._replay(pending.tokens[:keep_rows])
        self._offset += keep_rows
        self._ids.extend(pending.tokens[:keep_rows])
        if pending.features is not None and keep_rows:
            rows = pending.features
            # Every row kept (each plain step): no slice op to build and carry.
            self._add_features(rows if keep_rows == int(rows.shape[0]) else rows[:keep_rows])

    def take_features(self) -> mx.array | None:
        """Features of the rows committed since the last call: float32 [rows, len(capture) * hidden].

        Rows are in position order; after `reset(keep)` the next call returns all kept rows. None
        when no layers are configured. Columns follow `capture_layers` (see `feature_columns`).
        """
        if not self._capture:
            return None
        unread = self._feature_chunks[self._features_read :]
        self._features_read = len(self._feature_chunks)
        if len(self._feature_chunks) > _COMPACT_AFTER:
            self._feature_chunks = [mx.concatenate(self._feature_chunks, axis=0)]
            self._features_read = 1
        if not unread:
            return mx.zeros((0, len(self._capture) * self._hidden), dtype=mx.float32)
        rows = unread[0] if len(unread) == 1 else mx.concatenate(unread, axis=0)
        return rows.astype(mx.float32)

    def hand_over_features(self) -> tuple[mx.array | None, mx.array | None]:
        """(features of the rows `take_features` already handed out, those of the rows it has not), float32,
        for a row that moves into the batch: the first part stays in its saved states, the second goes to its
        drafter. (None, None) when this request records none."""
        if not self._recording:
            return None, None
        unread = self.take_features()  # not None: a request records only where layers are captured
        assert unread is not None
        history = self._all_features()
        read = history[: int(history.shape[0]) - int(unread.shape[0])].astype(mx.float32)
        return (read if int(read.shape[0]) else None), unread

    # Internals ------------------------------------------------------------------------------------

    def _plain_step(self, anchor: int, sampling: SamplingParams, uniform: float, ahead: float | None) -> Acceptance:
        """One token after `anchor`, using the step queued by the previous verify when it predicted this one."""
        queued, self._ahead = self._ahead, None
        if queued is not None and not (
            queued.anchor == anchor and queued.uniform == uniform and queued.sampling == sampling
        ):
            self._ahead = queued
            self._drop_ahead()
            queued = None
        if queued is not None:
            token, checkpoint, features = queued.next_token, queued.checkpoint, queued.features
        else:
            checkpoint = None if self._plain else cache_ops.Checkpoint(self._caches)
            token, features = self._queue_step(mx.array([anchor]), sampling, uniform)
        self._pending = _Pending([anchor], checkpoint, features)
        if ahead is not None:
            # Queue the next step on the token before reading it: the host builds it while this one runs.
            ahead_checkpoint = None if self._plain else cache_ops.Checkpoint(self._caches)
            nxt, nxt_features = self._queue_step(token, sampling, ahead)
            self._ahead = _Ahead(token, nxt, ahead, sampling, ahead_checkpoint, nxt_features)
        value = int(cast(int, token.item()))
        if self._ahead is not None:
            self._ahead.anchor = value
        return Acceptance(accepted=0, next_token=value)

    def _queue_step(
        self, token: mx.array, sampling: SamplingParams, uniform: float
    ) -> tuple[mx.array, mx.array | None]:
        """Forward one token (host or device array of shape [1]) and queue its pick with async_eval."""
        logits = self._forward(token, record=self._recording, compiled=True)[0, -1]
        features = self._recorded() if self._recording else None
        nxt = pick_token(logits, sampling, uniform)
        if features is None:
            mx.async_eval(nxt)
        else:
            mx.async_eval(nxt, features)
        return nxt, features

    def _drop_ahead(self) -> None:
        """Undo a queued plain step exactly (its row is the newest)."""
        queued, self._ahead = self._ahead, None
        if queued is None:
            return
        if cache_ops.can_cut(self._caches, 1):
            cache_ops.cut(self._caches, 1)
        else:
            assert queued.checkpoint is not None
            queued.checkpoint.restore()
            cache_ops.trim_offset_caches(self._caches, 1)

    def _install_taps(self) -> _TapHub:
        return install_taps(self._layers)

    def _forward(self, tokens: mx.array, record: bool, *, compiled: bool = False) -> mx.array:
        """Run tokens (ids [n]) after the cached rows; the taps record into this target when `record`.
        `compiled`: a verify or a plain step, run as the compiled graph where that applies (`compiled_forward`)."""
        if tokens.ndim != 1:  # a queued step's input is the previous step's 0-d pick
            tokens = tokens.reshape(-1)
        if compiled and self._compiles(int(tokens.shape[0])):
            assert self._compiled is not None
            layers = tuple(sorted(self._recorder.wanted)) if record and self._capture else ()
            try:
                logits, features = self._compiled(tokens, self._caches, layers)
            except Exception as exc:  # a backend that cannot trace this model: verify eagerly from now on
                warnings.warn(f"compiled verify off for this model: {exc!r}", RuntimeWarning, stacklevel=2)
                self._compiled = None
            else:
                self._recorder.rows = dict(zip(layers, features, strict=True))
                return logits
        self._hub.recorder = self._recorder
        self._recorder.active = record and bool(self._capture)
        try:
            with cpu_kernels.active():
                logits: mx.array = self._model(tokens.reshape(1, -1), cache=self._caches)
            return logits
        finally:
            self._recorder.active = False
            key_buckets.disarm()

    def _compiles(self, rows: int) -> bool:
        """Whether a forward of `rows` rows runs as the compiled graph: this process compiles forwards of that
        kind (plain steps or verifies), the caches are dense, and on the CPU a verify's attention is small."""
        if self._compiled is None or not (self._compile_steps if rows == 1 else self._compile_verifies):
            return False
        if not self._compiled.applies(self._caches, rows):
            return False
        if rows > 1 and self._verify_scores is not None:
            width = max(int(self._caches[0].keys.shape[2]), self._offset + rows)  # the padded keys it attends
            return rows * width < self._verify_scores
        return True

    def _start_recording(self, layers: Sequence[int]) -> _Recorder:
        """The recorder of a traced compiled forward, its taps armed for `layers` (none: nothing recorded)."""
        self._hub.recorder = rec = _Recorder()
        rec.wanted, rec.active = frozenset(layers), bool(layers)
        return rec

    def _make_caches(self) -> list[Any]:
        return cache_ops.make_caches(self._model, self._kv_bits, self._kv_group_size, buckets=self._buckets)

    def _fresh(self) -> None:
        self._ahead = None
        self._pending = None
        self._caches = self._make_caches()
        self._plain = cache_ops.all_cut_by_offset(self._caches)
        self._offset = 0
        self._ids = []
        self._feature_chunks = []
        self._feature_rows = 0
        self._features_read = 0

    def _recorded(self) -> mx.array | None:
        """The captured rows of the forward that just ran, [rows, len(capture) * hidden]."""
        rec = self._recorder
        if not self._capture or not rec.rows:
            return None
        parts = [rec.rows[i][0] for i in self._capture]
        rec.rows = {}
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    def _add_features(self, rows: mx.array | None) -> None:
        if rows is not None and rows.shape[0]:
            self._feature_chunks.append(rows)
            self._feature_rows += int(rows.shape[0])

    def _keep_features(self, n: int) -> None:
        """Keep the features of the first `n` rows; the next take_features hands out all of them."""
        self._features_read = 0
        if n == self._feature_rows and len(self._feature_chunks) <= 1:
            return
        history = self._all_features()[:n]
        self._feature_chunks = [history] if n else []
        self._feature_rows = n

    def _all_features(self) -> mx.array:
        if not self._feature_chunks:
            return mx.zeros((0, len(self._capture) * self._hidden), dtype=mx.float32)
        return mx.concatenate(self._feature_chunks, axis=0)

    def _rewind(self, pending: _Pending, width: int) -> None:
        """Put every cache back as it was before the verify."""
        if pending.checkpoint is not None:
            pending.checkpoint.restore()
        cache_ops.trim_offset_caches(self._caches, width)

    def _replay(self, tokens: list[int]) -> None:
        """Run kept rows again after a rewind; their logits are never read, so the head is not computed."""
        self._forward(mx.array(tokens), record=False)
