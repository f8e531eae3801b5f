"""A target sharded over several processes with `mx.distributed` (ring on TCP, JACCL, MPI, NCCL), speculation on top.

Every rank holds one tensor-parallel shard of the same model (mlx-lm's own `shard` methods: attention heads and
MLP columns split, one all-reduce after each) and a full `MlxTargetModel` around it, so each rank's forward
ends in the same all-reduced hidden states and logits, bit for bit. Rank 0 runs the engine and the drafter;
`MirroredTarget` sends each TargetModel call to the other ranks before it makes it itself, and `serve_worker`
makes the same call on theirs. With the same logits, the same uniforms and the same arguments every rank takes
the same acceptance decision and commits the same rows: a verify of a whole block pays the link once.

The channel is `all_sum` itself: rank 0 contributes the message, the others zeros, each collective evaluated at
once so that every rank runs them in one order. A drafter's on-device block is therefore summed (not read back)
before the verify that uses it. A prefix-cache state is a slot every rank fills with its own shard's state
(`MirroredState`); loading one loads each rank's, and a state the cache evicts is dropped on every rank at the
next call.

A rank that dies breaks the ring's sockets and the next collective raises at once. A rank that hangs would block
rank 0's all-reduces forever, so rank 0 makes its target calls on a link thread and waits at most the rank timeout
(`--rank-timeout`, 60 s): the request then ends with a clear error and every later call fails fast.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import functools
import itertools
import os
import queue
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_dspark.adapters.mlx.acceptance import as_q_rows
from mlx_dspark.adapters.mlx.readback import DeviceTokens
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.errors import IncompatibleDrafter, ModelUnavailable
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.outcome import Acceptance

_HEADER = 16  # int32 slots of a call header: op, then the call's integers


class Op(enum.IntEnum):
    STOP = 1
    RESET = 2
    PREFILL = 3
    EXTEND = 4
    VERIFY = 5
    COMMIT = 6
    TAKE_FEATURES = 7
    CAPTURE = 8
    PING = 9
    SAVE = 10
    LOAD = 11
    DROP = 12


def shard(model: Any, group: mx.distributed.Group) -> Any:
    """Split `model` over `group` with mlx-lm's tensor parallelism (in place); refuses families without it."""
    if group.size() == 1:
        return model
    if not callable(getattr(model, "shard", None)):
        raise ModelUnavailable(message=f"{type(model).__module__}: mlx-lm has no tensor-parallel sharding for it")
    model.shard(group)
    # Layer by layer: with lazily loaded weights each layer's whole tensors exist only while its slices are
    # cut, so a rank never holds much more than its shard.
    for layer in getattr(model, "layers", []):
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def _float_bits(x: float) -> int:
    return int(struct.unpack("<i", struct.pack("<f", float(x)))[0])


def _bits_float(i: int) -> float:
    return float(struct.unpack("<f", struct.pack("<i", int(i)))[0])


class RankTimeout(RuntimeError):
    """A collective did not complete in time: some rank hung, or is far behind."""


class _Link:
    """Runs rank 0's target calls on a thread of their own, so the engine waits a bounded time.

    A hung peer blocks an all-reduce inside the backend (a call's header, or the shard's own all-reduces inside
    a forward), where nothing can interrupt it. Every call, collectives and forwards alike, runs on this one
    thread, in the order the engine makes them (so in the other ranks' order: the ring pairs all-reduces by
    order); the engine gives up after `timeout_s` and abandons the stuck thread (a daemon), and every later
    call fails fast, since the group is lost either way. MLX evaluates a graph on the thread that built it: array
    arguments are evaluated on the caller's thread first, array results on this one before they are handed back.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="mlx-dspark-link", daemon=True)
        self._thread.start()
        self.stuck = False
        atexit.register(self._exit_if_stuck)

    def _exit_if_stuck(self) -> None:
        # A thread blocked inside the backend would hold the interpreter's teardown: end the process now.
        if self.stuck:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(1)

    def _serve(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed to the caller
                box.append((False, exc))
            done.set()

    def run(self, fn: Callable[[], Any]) -> Any:
        if self.stuck:
            raise RankTimeout("an earlier collective never completed")
        box: list[Any] = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        if not done.wait(self.timeout_s):
            self.stuck = True
            raise RankTimeout(f"no answer from every rank within {self.timeout_s:g} s: a rank hung or is far behind")
        ok, value = box[0]
        if not ok:
            raise value
        return value


def rank_timeout_s(value: float | None) -> float | None:
    """The bound on one collective at rank 0: `value`, else $MLX_DSPARK_RANK_TIMEOUT, else 60 s; <= 0: none."""
    if value is None:
        raw = os.environ.get("MLX_DSPARK_RANK_TIMEOUT", "").strip()
        value = float(raw) if raw else DEFAULT_RANK_TIMEOUT_S
    return value if value > 0 else None


DEFAULT_RANK_TIMEOUT_S = 60.0  # far above a forward's spread between ranks; far below "forever"


class Channel:
    """Rank 0's calls to the others over the group's all-reduce (rank 0 sends, every rank receives)."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()

    def _sum(self, a: mx.array) -> mx.array:
        return mx.distributed.all_sum(a if self.rank == 0 else mx.zeros_like(a), group=self.group)

    def header(self, values: Sequence[int] = ()) -> list[int]:
        """Rank 0 passes the header; every rank gets it back (host values: one sync)."""
        if len(values) > _HEADER:
            raise ValueError(f"a call header holds at most {_HEADER} integers")
        out = self._sum(mx.array([*values, *[0] * (_HEADER - len(values))], dtype=mx.int32))
        return [int(v) for v in out.tolist()]

    # Every collective is evaluated where it is made: ranks must run their all-reduces in one order, and a lazy
    # one would run wherever the scheduler put it in the next graph.
    def ints(self, values: mx.array | Sequence[int], n: int) -> mx.array:
        """n int32 values from rank 0."""
        a = values if isinstance(values, mx.array) else mx.array(list(values), dtype=mx.int32)
        out = self._sum(a.astype(mx.int32) if self.rank == 0 else mx.zeros((n,), dtype=mx.int32))
        mx.eval(out)
        return out

    def floats(self, values: mx.array | None, shape: tuple[int, ...]) -> mx.array:
        """float32 values of `shape` from rank 0."""
        a = values if (self.rank == 0 and values is not None) else mx.zeros(shape, dtype=mx.float32)
        out = self._sum(a.astype(mx.float32))
        mx.eval(out)
        return out


def _sampling_ints(s: SamplingParams) -> list[int]:
    return [_float_bits(s.temperature), _float_bits(s.top_p), int(s.top_k)]


def _sampling_of(values: Sequence[int]) -> SamplingParams:
    return SamplingParams(temperature=_bits_float(values[0]), top_p=_bits_float(values[1]), top_k=int(values[2]))


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """A lost rank surfaces in a collective as the backend's RuntimeError (the ring: at once, when the peer's
    socket closes); from then on every call fails fast with one clear error instead of hanging."""

    @functools.wraps(method)
    def call(self: MirroredTarget, *args: Any, **kwargs: Any) -> Any:
        if self.lost is not None:
            raise ModelUnavailable(message=self.lost)
        try:

            def run() -> Any:
                self._send_drops()
                return method(self, *args, **kwargs)

            if self._link is None:
                return run()
            _evaluate_inputs(args, kwargs)
            return self._link.run(lambda: _evaluated(run()))
        except RuntimeError as exc:
            self.lost = f"the distributed target lost a rank ({exc}); restart every rank to serve again"
            raise ModelUnavailable(message=self.lost) from exc

    return call


def _evaluate_inputs(args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Finish a call's array arguments here (a drafter's on-device block and its q): see `_Link`."""
    arrays: list[mx.array] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, DraftBlock):
            if isinstance(value.pending, DeviceTokens):
                arrays.append(value.pending.array)
            if isinstance(value.q, mx.array):
                arrays.append(value.q)
        elif isinstance(value, mx.array):
            arrays.append(value)
    if arrays:
        mx.eval(arrays)


def _evaluated(value: Any) -> Any:
    """A call's result with its arrays finished on the thread that built them (see `_Link`)."""
    parts = value if isinstance(value, tuple) else (value,)
    arrays = [p for p in parts if isinstance(p, mx.array)]
    if arrays:
        mx.eval(arrays)
    return value


class MirroredTarget:
    """Rank 0's TargetModel: each call goes to every other rank first, then runs on this rank's shard.

    Args:
        target: this rank's shard.
        channel: the group's call channel.
        timeout_s: the most one call may wait for the other ranks (a hung rank); None waits forever.
    """

    def __init__(self, target: MlxTargetModel, channel: Channel, *, timeout_s: float | None = None) -> None:
        if channel.rank != 0:
            raise ValueError("the mirrored target runs on rank 0; the other ranks run serve_worker")
        self._target = target
        self._channel = channel
        self._link = _Link(timeout_s) if timeout_s is not None and channel.group.size() > 1 else None
        self.timeout_s = timeout_s if self._link is not None else None
        self.shard_bytes = 0  # this rank's weights (set by the loader)
        self.load_peak_bytes = 0  # the most memory the load held at once on this rank (set by the loader)
        self._slots = itertools.count(1)
        self._dropped: list[int] = []  # slots of states the prefix cache let go, dropped on every rank next call
        self.lost: str | None = None
        self._stopped = False
        self.backend = "any"

    def __getattr__(self, name: str) -> Any:  # read-only properties and helpers of the local target
        return getattr(self._target, name)

    @_guarded
    def configure_capture(self, layer_ids: tuple[int, ...]) -> None:
        self._channel.header([Op.CAPTURE, len(layer_ids), *[i + 1 for i in layer_ids]])
        self._target.configure_capture(layer_ids)

    def add_capture(self, layer_ids: Sequence[int]) -> None:
        union = self._target.capture_layers + tuple(i for i in layer_ids if i not in self._target.capture_layers)
        self.configure_capture(tuple(dict.fromkeys(union)))

    @_guarded
    def reset(self, keep: int = 0, *, capture: bool = True) -> int:
        self._channel.header([Op.RESET, keep, int(capture)])
        return self._target.reset(keep, capture=capture)

    @_guarded
    def prefill(self, tokens: Sequence[int], sampling: SamplingParams, uniform: float) -> int:
        self._channel.header([Op.PREFILL, len(tokens), *_sampling_ints(sampling), _float_bits(uniform)])
        self._channel.ints(tokens, len(tokens))
        return self._target.prefill(tokens, sampling, uniform)

    @_guarded
    def extend(self, tokens: Sequence[int]) -> None:
        self._channel.header([Op.EXTEND, len(tokens)])
        self._channel.ints(tokens, len(tokens))
        self._target.extend(tokens)

    @_guarded
    def verify(
        self,
        anchor: int,
        block: DraftBlock,
        sampling: SamplingParams,
        uniforms: Sequence[float],
        *,
        ahead: float | None = None,
    ) -> Acceptance:
        k = len(block)
        has_q = block.q is not None and not sampling.greedy
        vocab = self._target.vocab_size
        head = [Op.VERIFY, anchor, k, int(has_q), int(ahead is not None), _float_bits(ahead or 0.0), len(uniforms)]
        self._channel.header([*head, *_sampling_ints(sampling)])
        self._channel.floats(mx.array(list(uniforms), dtype=mx.float32), (len(uniforms),))
        if k:  # rank 0 verifies its own block; the sums feed the others
            on_device = block.pending if isinstance(block.pending, DeviceTokens) else None
            self._channel.ints(on_device.array if on_device else list(block.tokens), k)
            if has_q:
                self._channel.floats(as_q_rows(block.q, k), (k, vocab))
        return self._target.verify(anchor, block, sampling, uniforms, ahead=ahead)

    @_guarded
    def commit(self, keep_rows: int) -> None:
        self._channel.header([Op.COMMIT, keep_rows])
        self._target.commit(keep_rows)

    @_guarded
    def take_features(self) -> Any:
        self._channel.header([Op.TAKE_FEATURES])
        return self._target.take_features()

    @_guarded
    def hand_over_features(self) -> Any:
        self._channel.header([Op.TAKE_FEATURES])
        return self._target.hand_over_features()

    @property
    def state_tag(self) -> str:
        tag = self._target.state_tag
        return f"{tag};tp{self._channel.group.size()}" if tag else ""

    @_guarded
    def save_state(self) -> MirroredState:
        slot = next(self._slots)
        self._channel.header([Op.SAVE, slot])
        local = self._target.save_state()
        return MirroredState(slot, local, self._dropped)

    @_guarded
    def load_state(self, state: Any, keep: int) -> int:
        # A state of another target (or a file) exists on this rank only: every rank loads nothing then.
        mine = isinstance(state, MirroredState) and state.owner is self._dropped
        self._channel.header([Op.LOAD, state.slot if mine else 0, keep])
        return self._target.load_state(state.local if mine else None, keep)

    def _send_drops(self) -> None:
        while self._dropped:
            batch = [self._dropped.pop() for _ in range(min(len(self._dropped), _HEADER - 2))]
            self._channel.header([Op.DROP, len(batch), *batch])

    @_guarded
    def ping(self, repeats: int = 20) -> float:
        """Median seconds of one call's round trip to every rank (a header all-reduce and its host sync): the
        link cost each mirrored call pays on top of the shard's compute."""
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self._channel.header([Op.PING])
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def describe(self) -> dict[str, Any]:
        """What `doctor` shows: the backend, the ranks and the measured call round trip."""
        return {
            "backend": self.backend,
            "ranks": self._channel.group.size(),
            "call_round_trip_us": round(self.ping() * 1e6, 1),
            "rank_timeout_s": self.timeout_s,
            "shard_bytes": self.shard_bytes,
            "load_peak_bytes": self.load_peak_bytes,
        }

    @_guarded
    def stop(self) -> None:
        """Release the other ranks' `serve_worker` loops (once)."""
        if not self._stopped:
            self._stopped = True
            self._channel.header([Op.STOP])


class DistributedLoader:
    """The ModelLoader port over another loader: its target sharded over the group of `backend`.

    On rank 0 `load_target(target)` returns the model behind a MirroredTarget. On every other rank it serves
    rank 0's calls until rank 0 stops (or is lost), then ends the process: those ranks run nothing else. Other
    models (a draft model) load whole, where they are asked for: on rank 0.
    """

    def __init__(self, inner: Any, backend: str, target: str, *, rank_timeout: float | None = None) -> None:
        self._inner = inner
        self._backend = backend
        self._timeout = rank_timeout_s(rank_timeout)  # rank 0's bound on one collective (None: unbounded)
        self._target = target  # the model to shard; any other load (a draft model) is whole, on rank 0
        self._loaded: Any = None
        self._group: mx.distributed.Group | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def group(self) -> mx.distributed.Group:
        if self._group is None:
            try:
                self._group = mx.distributed.init(backend=self._backend, strict=self._backend != "any")
            except RuntimeError as exc:
                raise ModelUnavailable(
                    message=f"--distributed {self._backend}: no group to join ({exc}); start every rank with "
                    f"mlx.launch --backend {self._backend} (e.g. -n 2 for two local ranks, --hostfile for machines)"
                ) from exc
        return self._group

    def load_target(self, name: str) -> Any:
        import attrs

        if name == self._target and self._loaded is not None:  # a reload (the engine restarting)
            if self._loaded.target.lost is not None:
                raise ModelUnavailable(message=self._loaded.target.lost)
            return self._loaded
        mx.reset_peak_memory()
        loaded = self._inner.load_target(name)
        if name != self._target:
            return loaded
        group = self.group
        model = shard(loaded.handle, group)
        load_peak = mx.get_peak_memory()  # with a lazy loader: this shard's weights, never the whole model's
        target = MlxTargetModel(model)
        channel = Channel(group)
        if group.rank() != 0:
            try:
                serve_worker(target, channel)
            except RuntimeError:  # rank 0 is gone: nothing left to follow
                raise SystemExit(1) from None
            raise SystemExit(0)
        mirrored = MirroredTarget(target, channel, timeout_s=self._timeout)
        mirrored.backend = self._backend
        mirrored.load_peak_bytes = load_peak
        mirrored.shard_bytes = sum(int(v.nbytes) for _, v in tree_flatten(model.parameters()))
        atexit.register(_stop_quietly, mirrored)
        self._loaded = attrs.evolve(loaded, target=mirrored, identity=f"{loaded.identity}+tp{group.size()}")
        return self._loaded

    def draft_model_source(self, draft: Any) -> Any:
        if isinstance(draft.target, MirroredTarget):
            raise IncompatibleDrafter(
                message="the draft model cannot be the sharded target itself: give --draft-model another model"
            )
        return self._inner.draft_model_source(draft)


class MirroredState:
    """A prefix-cache state of a distributed target: rank 0's own state, and the slot where every other rank keeps
    its shard's. Sizes are rank 0's (each rank holds as much). It exists on several processes at once, so it is
    never written to one file (`spillable`)."""

    spillable = False

    def __init__(self, slot: int, local: Any, owner: list[int]) -> None:
        self.slot = slot
        self.local = local
        self.owner = owner  # the target's drop list: where this slot goes when the cache lets go of it
        self.nbytes: int = local.nbytes
        self.min_length: int = local.min_length
        self.tokens = local.tokens

    def __del__(self) -> None:
        self.owner.append(self.slot)  # list.append is atomic: safe from a collector run on any thread


def _stop_quietly(target: MirroredTarget) -> None:
    with contextlib.suppress(ModelUnavailable):
        target.stop()


def serve_worker(target: MlxTargetModel, channel: Channel, states: dict[int, Any] | None = None) -> int:
    """Make rank 0's calls on this rank's shard until it says stop; returns the calls served.

    `states` holds this rank's shard of each prefix-cache state rank 0 keeps, by slot (pass one to look in)."""
    vocab = target.vocab_size
    served = 0
    states = {} if states is None else states
    while True:
        h = channel.header()
        op = Op(h[0])
        served += 1
        if op is Op.STOP:
            return served
        if op is Op.CAPTURE:
            target.configure_capture(tuple(i - 1 for i in h[2 : 2 + h[1]]))
        elif op is Op.RESET:
            target.reset(h[1], capture=bool(h[2]))
        elif op is Op.PREFILL:
            tokens = channel.ints((), h[1]).tolist()
            target.prefill(tokens, _sampling_of(h[2:5]), _bits_float(h[5]))
        elif op is Op.EXTEND:
            target.extend(channel.ints((), h[1]).tolist())
        elif op is Op.VERIFY:
            anchor, k, has_q, has_ahead = h[1], h[2], bool(h[3]), bool(h[4])
            uniforms = channel.floats(None, (h[6],)).tolist()
            block = DraftBlock()
            if k:
                drafts = tuple(channel.ints((), k).tolist())
                block = DraftBlock(tokens=drafts, q=channel.floats(None, (k, vocab)) if has_q else None)
            sampling = _sampling_of(h[7:10])
            target.verify(anchor, block, sampling, uniforms, ahead=_bits_float(h[5]) if has_ahead else None)
        elif op is Op.COMMIT:
            target.commit(h[1])
        elif op is Op.TAKE_FEATURES:
            target.take_features()
        elif op is Op.SAVE:
            states[h[1]] = target.save_state()
        elif op is Op.LOAD:
            target.load_state(states.get(h[1]), h[2])
        elif op is Op.DROP:
            for slot in h[2 : 2 + h[1]]:
                states.pop(slot, None)
        elif op is Op.PING:
            pass
