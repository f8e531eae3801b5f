# ruff: noqa: E402 - the BLAS swap and the transformers stub must precede every mlx / mlx_lm import
"""Device bench (issue 26): every mode on the real default model, and random-weight targets with forced acceptance.

Lab tooling for one GPU slot; it runs anywhere MLX does (tested on the CPU, where MLX runs the same graphs).

`real` runs plain decoding, lookup, DSpark, DFlash and auto through the project's own GenerationService on an
export of the default model, per mode: the first request (a prompt length no request of the process had), the
same three held-out prompts twice (the second pass is "seen once"), then one prompt three more times (warm;
the last two time every round: host graph building, dispatch, drafter device time, verify readback). The JSON
is the `mlx-dspark bench --json` document (schema `mlx-dspark/bench/5`; its runs are the seen-once pass) plus
a `device_bench` section.

`synthetic` builds Qwen3-0.6B / 4B / 8B, Qwen2.5-32B and a qwen3_5 hybrid shape from random bf16 weights on the
device (nothing to upload) and times the engine alone: one plain step against a round whose drafts an oracle
makes the verify accept for exactly τ positions (τ = 1..7; cap 7 and cap τ+1), as speedup and as efficiency
against the ideal of τ+1 tokens for one step's cost.

The slot runner's commands, in the checkout's root on the device (M = the staged export's folder):

    PYTHONPATH=$HOME/mlx-site:. python3 scripts/device_bench.py all --smoke --model $M --json $OUT/smoke.json
    PYTHONPATH=$HOME/mlx-site:. python3 scripts/device_bench.py all --model $M --json $OUT/db.json --table $OUT/db.md

and on the CPU side, before the slot (writes the export, ~100 MB: stage it with scripts/gpu_parts.py):

    .venv/bin/python scripts/device_bench.py export --out build/default-export

`real --model DIR ...` and `synthetic --shapes 0.6b,4b,8b,32b,hybrid --dtype bf16 --taus 1,2,4,7 ...` run one
half each, with `--budget-seconds` (`all`: `--real-budget-seconds`, default 210, `--synthetic-budget-seconds`,
default 170): a half stops between requests and still writes what it measured, and the JSON is rewritten after
every mode and shape, so even a killed run leaves a document. Needs only mlx and mlx_lm with their own
dependencies, attrs and numpy: transformers and cattrs are stood in for where missing, mlx_dspark is mapped
onto this checkout when not installed, tokenizers and jinja2 are used when present (else the export's
pre-encoded prompts).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import os
import statistics
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # gpu_bench and gpu_distill: their loaders and the transformers stub
sys.path.insert(1, str(HERE.parent))  # tests.near_ties


def _package_from_checkout() -> None:
    """Import `mlx_dspark.<layer>` from this checkout's folders when no install provides it (a bare device)."""
    try:
        import mlx_dspark.domain.ports  # noqa: F401
    except ImportError:
        package = types.ModuleType("mlx_dspark")
        package.__path__ = [str(HERE.parent)]  # mlx_dspark.domain -> <checkout>/domain, as setup.py maps it
        sys.modules["mlx_dspark"] = package


class _Inert:
    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _stand_in(name: str, **attributes: Any) -> None:
    """Where `name` is missing: a module holding what import-time code touches (the bench never uses more)."""
    try:
        importlib.import_module(name)
    except ImportError:
        stub = types.ModuleType(name)
        stub.__dict__.update(attributes)
        sys.modules[name] = stub


_package_from_checkout()
# application.settings builds a cattrs converter at import (the bench never parses settings); the engine
# takes a structlog logger at import (an inert one logs nothing).
_stand_in(
    "cattrs",
    Converter=_Inert,
    BaseValidationError=type("BaseValidationError", (Exception,), {}),
    transform_error=lambda exc: [str(exc)],
)
_stand_in("structlog", get_logger=lambda *args, **kwargs: _Inert())

from mlx_dspark.adapters.mlx.runtime import MlxRuntime

with contextlib.suppress(Exception):  # what every entrypoint runs first (the CPU BLAS; GPU builds report "native")
    MlxRuntime().prepare()

import gpu_bench

gpu_bench._import_mlx_lm_generate()  # installs the transformers stub where transformers is missing

import attrs
import gpu_distill
import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application.auto_mode import cap_policy_factory, measure_and_choose
from mlx_dspark.application.calibration import CalibrationPlan
from mlx_dspark.application.data import heldout_prompts, interleaved
from mlx_dspark.application.generation import GenerationRequest, GenerationResult, GenerationService
from mlx_dspark.application.lab.bench import (
    BenchReport,
    BenchRun,
    auto_verdicts,
    first_divergence,
    report_json,
    summarize,
    synthetic_prompt,
)
from mlx_dspark.application.warmup import SwitchAfter, warm_up
from mlx_dspark.domain.costmodel.draft_cap import FixedCap
from mlx_dspark.domain.drafting.block import EMPTY_BLOCK, DraftBlock, DraftContext
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.drafting.selection import Selection
from mlx_dspark.domain.events import Finished, RoundFinished, SourceSwitched, TokensCommitted
from mlx_dspark.domain.model import LoadedModel
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from tests import near_ties  # the lab's near-tie reading (mlx, numpy and attrs only)

try:  # the decode loop moves into application.engine (issue 26's rewrite); either tree runs this
    from mlx_dspark.application.engine import decode
except ImportError:
    from mlx_dspark.application.decode_loop import decode

SCHEMA = "mlx-dspark/device-bench/1"
GREEDY = SamplingParams()
PLAIN = "baseline"
MODES = (PLAIN, "lookup", "dspark", "dflash", "auto")
# A/B for auto's plain rounds (not in the default list): plain decoding under a switcher that never moves, so the
# target records features every step as it does inside auto. Against PLAIN in the same run it prices the capture
# and the per-round switcher call; what auto's baseline rounds lose beyond that is the arbiter's doing.
PLAIN_CAPTURE = "baseline-capture"
SHIPPED = HERE.parent / "adapters" / "hf" / "drafters_data" / "default"
PROMPTS_FILE = "bench_prompts.json"
ROUND_TIME = "wall time between rounds minus the oracle's propose (what remains: the real verify, commit, the loop)"
BREAKDOWN_FIELDS = {
    "round_s": "one round's wall time (this round's first call to the next round's)",
    "draft_s": "the draft source's propose on the host (graph building and dispatch; the drafter may still run)",
    "draft_build_s": "propose until its graph is handed to the device (the first async_eval)",
    "drafter_device_s": "profiled pass only: waiting for the device after propose (the drafter's device time)",
    "verify_build_s": "verify until its first async_eval (host graph building; plain decoding: the queued next step)",
    "dispatch_s": "time inside async_eval calls (launching the graph), draft and verify together",
    "readback_s": "verify's last async_eval until its verdict is on the host (waiting for the device)",
    "commit_s": "the target's commit (rollback of rejected rows)",
    "loop_other_s": "the rest: decode loop, acceptance bookkeeping, detokenization, events",
    "host_s": "round_s - readback_s - drafter_device_s: host work the device waits on unless a queued step hides it",
}


def now() -> float:
    return time.perf_counter()


class Budget:
    """Seconds this run may still spend; checked between requests and runs, never inside one."""

    def __init__(self, seconds: float, clock: Callable[[], float] = now) -> None:
        self._clock = clock
        self._end = clock() + seconds
        self.stopped = False

    def left(self) -> float:
        return self._end - self._clock()

    def spent(self) -> bool:
        """True once the budget is gone (and remembered, so the document can say it stopped early)."""
        if self.left() <= 0:
            self.stopped = True
        return self.stopped


def write_atomic(path: Path | None, text: str) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _median(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def environment() -> dict[str, Any]:
    from mlx_dspark.adapters.mlx.device import describe_runtime

    env = describe_runtime()
    env["host"] = os.uname().nodename
    return env


def device_memory_bytes() -> int:
    """What the default device can hold: the GPU's memory, else the host's available memory."""
    with contextlib.suppress(AttributeError, RuntimeError, TypeError, ValueError):
        if mx.default_device().type == mx.gpu:
            info = mx.device_info()
            # Metal reports memory_size (an int); the CUDA build total_memory (a string of digits).
            return int(info.get("memory_size") or info.get("total_memory") or 0)
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def free_memory() -> None:
    gc.collect()
    mx.clear_cache()


# ------------------------------------------------------------------------------------------------------------
# Timing rounds at the bench level: proxies around the target and the draft sources, and marks on every
# mx.async_eval (the moment a graph is handed to the device). Off, the proxies only forward.


class _Call:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.start = now()
        self.end = self.start
        self.dispatches: list[tuple[float, float]] = []  # (enter, return) of each async_eval inside the call
        self.barrier_s = 0.0  # profiled pass: waiting for the drafter's device work after propose


class RoundCalls:
    """Records verify / propose / commit calls (and the async_evals inside them) while `on`.

    `barrier` (the profiled pass) waits for the device after each propose, so the drafter's device time is
    measured apart from the verify's; it perturbs the round (the device would otherwise overlap it).
    """

    def __init__(self) -> None:
        self.on = False
        self.barrier = False
        self.calls: list[_Call] = []
        self._current: _Call | None = None

    @contextlib.contextmanager
    def recording(self, *, barrier: bool) -> Iterator[None]:
        real = mx.async_eval

        def marked(*arrays: Any) -> None:
            t_in = now()
            real(*arrays)
            if self._current is not None:
                self._current.dispatches.append((t_in, now()))

        self.calls, self.on, self.barrier = [], True, barrier
        mx.async_eval = marked
        try:
            yield
        finally:
            mx.async_eval = real
            self.on = self.barrier = False

    @contextlib.contextmanager
    def call(self, kind: str) -> Iterator[_Call]:
        rec = _Call(kind)
        self._current = rec
        try:
            yield rec
        finally:
            rec.end = now()
            self._current = None
            self.calls.append(rec)

    def rounds(self) -> list[dict[str, float]]:
        """One entry per verify: its propose before it, its commit after it, and the wall to the next round."""
        groups: list[list[_Call]] = []
        pending: list[_Call] = []
        for c in self.calls:
            if c.kind == "propose":
                pending = [c]
            elif c.kind == "verify":
                groups.append([*pending, c])
                pending = []
            elif c.kind == "commit" and groups:
                groups[-1].append(c)
        out = []
        for i, g in enumerate(groups):
            start = g[0].start
            end = groups[i + 1][0].start if i + 1 < len(groups) else g[-1].end
            by = {c.kind: c for c in g}
            verify, propose, commit = by["verify"], by.get("propose"), by.get("commit")
            last = verify.dispatches[-1] if verify.dispatches else (verify.end, verify.end)
            first_v = verify.dispatches[0][0] if verify.dispatches else verify.end
            draft_s = (propose.end - propose.start) if propose else 0.0
            barrier = propose.barrier_s if propose else 0.0
            first_d = propose.dispatches[0][0] if propose and propose.dispatches else (propose.end if propose else 0)
            readback = verify.end - last[1]
            round_s = end - start
            verify_s = verify.end - verify.start
            commit_s = (commit.end - commit.start) if commit else 0.0
            out.append(
                {
                    "round_s": round_s,
                    "draft_s": draft_s - barrier,
                    "draft_build_s": (first_d - propose.start) if propose else 0.0,
                    "drafter_device_s": barrier,
                    "verify_build_s": first_v - verify.start,
                    "dispatch_s": sum(b - a for c in g for a, b in c.dispatches),
                    "readback_s": readback,
                    "commit_s": commit_s,
                    "loop_other_s": round_s - draft_s - verify_s - commit_s,  # the loop's and the service's own
                    # Everything the host does in the round but wait: the device idles through it unless a
                    # queued step (plain decoding) or the drafter's graph keeps it busy.
                    "host_s": round_s - readback - barrier,
                }
            )
        return out


def breakdown(rounds: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Per-round medians of `RoundCalls.rounds()` (seconds)."""
    if not rounds:
        return {"rounds": 0}
    keys = rounds[0].keys()
    return {"rounds": len(rounds), **{k: _median([r[k] for r in rounds]) for k in keys}}


class TimedTarget:
    """The target port as the decode loop sees it, timing verify and commit while its `RoundCalls` is on;
    every prompt length it prefills is remembered (the first request must be a length never seen)."""

    def __init__(self, inner: Any, calls: RoundCalls) -> None:
        self._inner = inner
        self._calls = calls
        self.prompt_lengths: set[int] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def prefill(self, tokens: Sequence[int], sampling: SamplingParams, uniform: float) -> int:
        self.prompt_lengths.add(self._inner.cached_tokens + len(tokens))
        return int(self._inner.prefill(tokens, sampling, uniform))

    def verify(self, *args: Any, **kwargs: Any) -> Any:
        if not self._calls.on:
            return self._inner.verify(*args, **kwargs)
        with self._calls.call("verify"):
            return self._inner.verify(*args, **kwargs)

    def commit(self, keep_rows: int) -> None:
        if not self._calls.on:
            self._inner.commit(keep_rows)
            return
        with self._calls.call("commit"):
            self._inner.commit(keep_rows)


class TimedSource:
    """A draft source timing its propose calls while `RoundCalls` is on (and waiting for the device after
    each one in the profiled pass)."""

    def __init__(self, inner: Any, calls: RoundCalls) -> None:
        self._inner = inner
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]) -> DraftBlock:
        if not self._calls.on or cap == 0:
            return self._inner.propose(ctx, cap, sampling, uniforms)  # type: ignore[no-any-return]
        with self._calls.call("propose") as rec:
            block: DraftBlock = self._inner.propose(ctx, cap, sampling, uniforms)
            if self._calls.barrier:
                t = now()
                mx.synchronize()
                rec.barrier_s = now() - t
            return block


# ------------------------------------------------------------------------------------------------------------
# The real model: export, tokenizer, prompts.


class BenchTokenizer:
    """The Tokenizer port on the device: tokenizer.json through `tokenizers` and the chat template through jinja2
    when both import (gpu_distill.Chat); otherwise a byte-to-id stand-in, which only calibration text meets
    (the bench's prompts then come pre-encoded from the export)."""

    def __init__(self, model_dir: Path, eos_ids: Sequence[int], vocab_size: int) -> None:
        self._eos = frozenset(int(t) for t in eos_ids)
        self._vocab = vocab_size
        self.chat: Any = None
        self._template: str | None = None
        with contextlib.suppress(ImportError, OSError):
            self.chat = gpu_distill.Chat(model_dir)
            self._template = (model_dir / "chat_template.jinja").read_text()

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def chat_template(self) -> str | None:
        return self._template

    @property
    def max_token_bytes(self) -> int:
        return 0  # unknown; nothing here admits requests by size

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if self.chat is not None:
            return list(self.chat.tok.encode(text, add_special_tokens=add_special_tokens).ids)
        low = 256 if self._vocab > 1024 else 0
        return [low + (b * 7919) % (self._vocab - low) for b in text.encode()]

    def decode(self, ids: Sequence[int]) -> str:
        if self.chat is None:
            return ""
        return str(self.chat.tok.decode(list(ids), skip_special_tokens=False))

    def render_chat(self, messages: Any, *, tools: Any = None, template_kwargs: Any = None) -> str:
        return str(self.chat.template.render(messages=messages, add_generation_prompt=True, **(template_kwargs or {})))


def encode_prompts(tokenizer: BenchTokenizer) -> dict[str, Any]:
    """Every held-out prompt's ids through the chat template, and the auto race's prompts."""
    from types import SimpleNamespace

    from mlx_dspark.application.auto_mode import race_prompt_ids

    def ids(text: str) -> list[int]:
        return tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)

    rows = [{"id": p.id, "class": p.cls, "ids": ids(p.prompt)} for p in interleaved(heldout_prompts()).prompts]
    return {"heldout": rows, "race": race_prompt_ids(SimpleNamespace(tokenizer=tokenizer))}


def export(gguf: Path | None, out: Path) -> dict[str, Any]:
    """CPU side: the GGUF (default: the embedded default model) as gpu_distill's exact export, plus the
    held-out prompts pre-encoded (the device then needs no tokenizer library)."""
    if gguf is None:
        from mlx_dspark.adapters.hf.cache import cache_root
        from mlx_dspark.adapters.hf.default_models import embedded_gguf, ensure_installed

        ensure_installed("default")
        gguf = embedded_gguf("default", cache_root(None))
    gpu_distill.export_target(str(gguf), str(out))
    cfg = json.loads((out / "config.json").read_text())
    tok = BenchTokenizer(out, cfg["eos_token_id"], int(cfg["vocab_size"]))
    if tok.chat is None:
        raise RuntimeError("export needs `tokenizers` and `jinja2` to pre-encode the prompts")
    (out / PROMPTS_FILE).write_text(json.dumps(encode_prompts(tok)))
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    return {"gguf": str(gguf), "out": str(out), "files": files, "bytes": sum(files.values())}


def load_module(model_dir: Path, dtype: str) -> Any:
    """The export (or an mlx-lm directory) as an mlx-lm module: dequantized exactly and cast to `dtype`, or
    kept quantized (`quantized`)."""
    if dtype == "quantized":
        return gpu_bench.load_model(model_dir)
    return gpu_distill.load_target(model_dir, dtype)


def bench_prompts(model_dir: Path, tokenizer: BenchTokenizer) -> dict[str, Any]:
    file = model_dir / PROMPTS_FILE
    if file.is_file():
        return json.loads(file.read_text())  # type: ignore[no-any-return]
    if tokenizer.chat is None:
        raise RuntimeError(f"{model_dir} has no {PROMPTS_FILE} and no tokenizer can encode prompts here")
    return encode_prompts(tokenizer)


class _NullTelemetry:
    """Keeps auto's moves (SourceSwitched: old, new, reason) and the rounds (RoundFinished) of the request
    running now; nothing else."""

    def __init__(self) -> None:
        self.switches: list[str] = []
        self.rounds: list[Any] = []
        self.ends: list[float] = []  # when each round's event arrived (the decode loop's clock)

    def emit(self, request_id: str, event: Any) -> None:
        if type(event).__name__ == "SourceSwitched":
            self.switches.append(f"{len(self.rounds)}: {event.old}->{event.new}: {event.reason}")
        elif isinstance(event, RoundFinished):
            self.rounds.append(event)
            self.ends.append(now())

    def trace(self) -> list[list[Any]]:
        """Per round: [source, drafted, committed, wall ms since the previous round's end (the first: since its
        own verify began), draft ms, verify ms]: where a stint's rounds cost what a fixed mode's do not."""
        out: list[list[Any]] = []
        for i, (r, end) in enumerate(zip(self.rounds, self.ends, strict=True)):
            wall = end - self.ends[i - 1] if i else r.draft_s + r.verify_s
            out.append(
                [
                    r.source,  # "none": the round drafted nothing (plain decoding, or lookup without a match)
                    r.drafted,
                    r.committed,
                    round(wall * 1e3, 2),
                    round(r.draft_s * 1e3, 2),
                    round(r.verify_s * 1e3, 2),
                ]
            )
        return out


class _StallWatch:
    """Samples the bench thread's Python stack while one round has run past `after_s`: where the host is during a
    stall (the H100's one 23 s DFlash round of 2026-12-05 had no explanation), not a guess. A daemon thread, on
    only between `arm` and `disarm`; at most `per_round` samples a round and `keep` a request."""

    def __init__(
        self,
        telemetry: _NullTelemetry,
        after_s: float = 1.0,
        every_s: float = 0.25,
        keep: int = 48,
        per_round: int = 12,
    ) -> None:
        self._telemetry = telemetry
        self._after, self._every = after_s, every_s
        self._keep, self._per_round = keep, per_round
        self._thread = threading.get_ident()
        self._since: float | None = None
        self.samples: list[dict[str, Any]] = []
        threading.Thread(target=self._run, name="stall-watch", daemon=True).start()

    def arm(self) -> None:
        self.samples = []
        self._since = now()

    def disarm(self) -> None:
        self._since = None

    def _run(self) -> None:
        while True:
            time.sleep(self._every)
            since = self._since
            if since is None or len(self.samples) >= self._keep:
                continue
            ends = self._telemetry.ends
            start = max(ends[-1], since) if ends else since
            if now() - start < self._after:
                continue
            frame = sys._current_frames().get(self._thread)
            here = len(self._telemetry.rounds)
            if frame is None or sum(x["round"] == here for x in self.samples) >= self._per_round:
                continue  # a long stall keeps room for the next one
            stack = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)[-12:]]
            self.samples.append({"round": here, "waited_ms": round((now() - start) * 1e3), "stack": stack})


def divergence_report(
    module: Any, prompt: Sequence[int], plain: Sequence[int], spec: Sequence[int], rounds: Sequence[Any]
) -> dict[str, Any] | None:
    """Where a greedy output parts from plain decoding's, and whether that is a near-tie of the target
    (tests/near_ties.py: both forwards re-run, the gap against the dtype's rounding bound); None when equal."""
    i = first_divergence(plain, spec)
    if i is None:
        return None
    out: dict[str, Any] = {
        "index": i,
        "tokens": [plain[i] if i < len(plain) else None, spec[i] if i < len(spec) else None],
    }
    if i >= min(len(plain), len(spec)) or i < 1:
        out["near_tie"] = False
        out["why"] = "one output stopped early" if i >= 1 else "the prefill's token differs"
        return out
    try:
        width, row, history = near_ties.locate(rounds, i)
        tie = near_ties.near_tie(
            module,
            list(prompt) + list(plain[:i]),
            (plain[i], spec[i]),
            width,
            row=row,
            prompt_len=len(prompt),
            rounds=history,
        )
    except Exception as exc:  # report, never lose the bench
        out["near_tie"] = None
        out["why"] = repr(exc)
        return out
    out.update(
        near_tie=tie.holds,
        reproduced=tie.reproduced,
        width=tie.width,
        row=tie.row,
        step_gap=tie.step.gap,
        verify_gap=tie.verify.gap,
        bound=tie.step.bound,
        spread_ulps=tie.spread_ulps,
        error_ulps=tie.error_ulps,
        describe=tie.describe(),
    )
    return out


class _MemoryCalibrations:
    """A CalibrationStore that keeps this run's measurements only (auto calibrates afresh on every device)."""

    def __init__(self) -> None:
        self._items: dict[Any, Any] = {}

    def load(self, key: Any) -> Any:
        return self._items.get(key)

    def save(self, key: Any, calibration: Any) -> None:
        self._items[key] = calibration


class _Stay:
    """A SourceSwitcher that never moves: its request records features as an auto request does."""

    def after_round(
        self,
        name: str,
        committed: int,
        seconds: float,
        *,
        drafted: int = 0,
        depth: int = 0,
        history: Sequence[int] = (),
    ) -> None:
        return None


class _StaySelector:
    """A mode under `_Stay`: plain decoding (the PLAIN_CAPTURE mode) or a fixed draft source at a fixed cap (the
    `<source>-stay` modes). Its request records and keeps every round's features and asks a switcher after each
    round, as an auto request does, running what the fixed mode runs. With `late` > 0 (the `<source>-late<N>`
    modes) the request starts in plain decoding and moves to the source after `late` rounds, as auto moves to a
    drafter it has not run for a while: that drafter's first round catches up on every row since."""

    def __init__(self, mode: str, source: Any = None, cap: int = 0, late: int = 0) -> None:
        self.mode = mode
        self._source = source
        self._cap = cap
        self._late = late

    def select(self, prompt: Sequence[int], sampling: SamplingParams | None = None) -> Selection:
        if self._source is None:
            return Selection(name=PLAIN, source=None, switcher=_Stay())
        fixed = Selection(name=self._source.name, source=self._source, policy=FixedCap(self._cap), switcher=_Stay())
        if not self._late:
            return fixed
        moved = SourceSwitched(old=PLAIN, new=self._source.name, reason=f"after {self._late} plain rounds")
        return Selection(name=PLAIN, source=None, switcher=SwitchAfter(self._late, attrs.evolve(fixed, switched=moved)))

    def sources(self) -> dict[str, Any]:
        """What the server's warm-up runs for this mode (`warmup.sources_of`): its source, and plain decoding
        where the mode runs plain steps."""
        out: dict[str, Any] = {} if self._source is None else {self._source.name: self._source}
        if self._source is None or self._late:
            out[PLAIN] = None
        return out

    def finished(self, selection: Selection, usage: Any) -> None:
        return None


def _runs(mode: str) -> tuple[str, int]:
    """(the source a mode runs, N): N for a `<source>-late<N>` mode, the source of a `<source>-stay` one, else the
    mode itself with 0."""
    kind, sep, n = mode.rpartition("-late")
    if sep and kind and n.isdigit() and int(n) > 0:
        return kind, int(n)
    return mode.removesuffix("-stay"), 0


class _Clock:
    def now(self) -> float:
        return now()


def first_prompt(pool: Sequence[dict[str, Any]], seen: set[int]) -> dict[str, Any]:
    """A prompt whose length no request has had: the first unseen one in `pool`, else the first made longer
    (its leading tokens repeated right after the first one, so it still ends in the generation prompt)."""
    for p in pool:
        if len(p["ids"]) not in seen:
            return p
    base = pool[0]
    ids = list(base["ids"])
    extra = 1
    while len(ids) + extra in seen:
        extra += 1
    padded = ids[:1] + (ids[1:] * (extra // max(len(ids) - 1, 1) + 1))[:extra] + ids[1:]
    return {**base, "id": f"{base['id']}+{extra}", "ids": padded}


def _run_record(mode: str, p: dict[str, Any], r: GenerationResult, trial: int = 0) -> BenchRun:
    return BenchRun(
        mode=mode,
        prompt_id=p["id"],
        cls=p["class"],
        trial=trial,
        decode_tok_s=r.tokens_per_second,
        e2e_tok_s=r.end_to_end_tokens_per_second,
        ttft_s=r.time_to_first_token_s,
        mean_accepted=r.mean_accepted,
        generated_tokens=r.generated_tokens,
        token_ids=r.token_ids,
        source=r.source,
        prompt_tokens=r.prompt_tokens,
        prefill_tok_s=(r.prompt_tokens - r.cached_prompt_tokens) / r.prefill_s if r.prefill_s > 0 else 0.0,
        source_switches=r.source_switches,
        source_rounds=dict(r.source_rounds),
    )


def stints(trace: Sequence[Sequence[Any]]) -> str:
    """A trace's runs of one source: `source rounds×(tokens/ms: first round's ms, then the rest's tok/s)`."""
    parts: list[str] = []
    i = 0
    while i < len(trace):
        j = i
        while j < len(trace) and trace[j][0] == trace[i][0]:
            j += 1
        rest = trace[i + 1 : j]
        ms = sum(t[3] for t in rest)
        rate = f"{1e3 * sum(t[2] for t in rest) / ms:.0f} tok/s" if ms > 0 else "-"
        parts.append(f"{trace[i][0]} {j - i}r first {trace[i][3]:.1f}ms/{trace[i][2]}t then {rate}")
        i = j
    return " | ".join(parts)


def _brief(p: dict[str, Any], r: GenerationResult) -> dict[str, Any]:
    return {
        "prompt_id": p["id"],
        "prompt_tokens": r.prompt_tokens,
        "generated_tokens": r.generated_tokens,
        "decode_tok_s": r.tokens_per_second,
        "ttft_s": r.time_to_first_token_s,
        "mean_accepted": r.mean_accepted,
        "source": r.source,
        "source_rounds": dict(r.source_rounds),
        "source_switches": r.source_switches,
    }


def run_real(
    model_dir: Path,
    *,
    dtype: str = "bfloat16",
    modes: Sequence[str] = MODES,
    max_tokens: int = 128,
    seen_prompts: int = 3,
    max_draft: int | None = 7,
    drafter_bits: int | None = None,
    drafters: dict[str, Path] | None = None,
    smoke: bool = False,
    warmup: bool = False,
    budget: Budget | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every mode on the model in `model_dir` through GenerationService; returns the bench document plus the
    `device_bench` section (see the module docstring for the protocol). With `warmup`, each mode first runs the
    server's warm-up (`application.warmup`), so its first request is the one a served user's would be."""
    from mlx_dspark.adapters.mlx.drafters import load_drafter

    budget = budget or Budget(math.inf)
    t_load = now()
    cfg = json.loads((model_dir / "config.json").read_text())
    module = load_module(model_dir, dtype)
    calls = RoundCalls()
    inner = MlxTargetModel(module)
    target = TimedTarget(inner, calls)
    eos = cfg.get("eos_token_id") or []
    tokenizer = BenchTokenizer(model_dir, eos if isinstance(eos, list) else [eos], inner.vocab_size)
    model = LoadedModel(
        name=str(model_dir),
        identity=f"device-bench:{model_dir.name}:{dtype}",
        target=target,  # type: ignore[arg-type]
        tokenizer=tokenizer,
        context_window=int(cfg.get("max_position_embeddings") or 8192),
        family=str(cfg.get("model_type", "unknown")),
        handle=module,
    )
    encoded = bench_prompts(model_dir, tokenizer)
    pool = [p for p in encoded["heldout"] if len(p["ids"]) < model.context_window - max_tokens - 8]
    seen_set, rest = pool[:seen_prompts], pool[seen_prompts:]
    race, rest = rest[:3], rest[3:]
    load_s = now() - t_load
    log(f"loaded {model_dir} ({dtype}) in {load_s:.1f}s; prompts {[len(p['ids']) for p in seen_set]}")

    where = {"dspark": SHIPPED / "dspark", "dflash": SHIPPED / "dflash", **(drafters or {})}
    sources: dict[str, Any] = {}
    errors: dict[str, str] = {}
    wanted = {_runs(m)[0] for m in modes}
    for kind in ("lookup", "dspark", "dflash"):
        if kind not in wanted and "auto" not in modes:
            continue
        try:
            if kind == "lookup":
                src: Any = LookupDraftSource()
            else:
                src = load_drafter(kind, str(where[kind]), module, target=inner, bits=drafter_bits)
            sources[kind] = TimedSource(src, calls)
        except Exception as exc:  # a drafter that cannot load is reported, the rest still run
            errors[kind] = repr(exc)
            log(f"{kind}: cannot load: {exc!r}")

    clock, telemetry = _Clock(), _NullTelemetry()
    watch = _StallWatch(telemetry)
    greedy = SamplingParams()
    order = [m for m in modes if m in (PLAIN, PLAIN_CAPTURE, "auto") or _runs(m)[0] in sources]
    order.sort(key=lambda m: m != PLAIN)
    per_mode: dict[str, Any] = {}
    runs: list[BenchRun] = []

    selectors: dict[str, Any] = {}  # auto's selector: its priors after each request go into the record

    def brief(p: dict[str, Any], r: GenerationResult, mode: str = "") -> dict[str, Any]:
        out = {**_brief(p, r), "switches": list(telemetry.switches), "trace": telemetry.trace()}
        if watch.samples:
            out["stalls"] = list(watch.samples)
            first = watch.samples[0]
            log(f"stall: {mode} {p['id']} round {first['round']}, {len(watch.samples)} samples: {first['stack'][-4:]}")
        if mode in selectors:
            out["priors_after"] = {k: round(v, 1) for k, v in selectors[mode].priors().items()}
        return out

    rounds_of: dict[tuple[str, Any], list[Any]] = {}  # (mode, prompt id) -> the seen-once run's rounds

    def request(service: GenerationService, p: dict[str, Any]) -> GenerationResult:
        target.reset(0)
        telemetry.switches.clear()
        telemetry.rounds = []
        telemetry.ends = []
        watch.arm()
        try:
            return service.generate(
                GenerationRequest(prompt=list(p["ids"]), max_tokens=max_tokens, sampling=greedy, prefix_cache=False)
            )
        finally:
            watch.disarm()

    def document() -> dict[str, Any]:
        fixed = [m for m in order if m != "auto" and m in per_mode]
        prompts = heldout_prompts()
        chosen = {p["id"] for p in seen_set}
        report = BenchReport(
            model=str(model_dir),
            model_identity=model.identity,
            prompt_set=attrs.evolve(prompts, prompts=tuple(p for p in prompts.prompts if p.id in chosen)),
            trials=1,
            max_tokens=max_tokens,
            temperature=0.0,
            modes=summarize(runs, [m for m in order if m in per_mode], greedy=True),
            runs=tuple(runs),
            environment=env,
            auto=auto_verdicts(runs, fixed),
        )
        doc = report_json(report)
        base = {r.prompt_id: r.token_ids for r in runs if r.mode == PLAIN}
        for mode, m in per_mode.items():
            rates = [r["decode_tok_s"] for r in m.get("seen_once", [])]
            m["seen_once_decode_tok_s"] = (
                {"min": min(rates), "median": _median(rates), "max": max(rates)} if rates else None
            )
            m["identical_to_plain"] = {
                r.prompt_id: first_divergence(base[r.prompt_id], r.token_ids) is None
                for r in runs
                if r.mode == mode and r.prompt_id in base
            }
            if mode != PLAIN:
                m.setdefault("divergences", {})
                for r in runs:
                    if r.mode != mode or r.prompt_id not in base or r.prompt_id in m["divergences"]:
                        continue
                    ids = next(p["ids"] for p in seen_set if p["id"] == r.prompt_id)
                    m["divergences"][r.prompt_id] = divergence_report(
                        module, ids, base[r.prompt_id], r.token_ids, rounds_of.get((mode, r.prompt_id), [])
                    )
        doc["device_bench"] = {
            "schema": SCHEMA,
            "dtype": dtype,
            "max_draft": max_draft,
            "drafter_bits": drafter_bits,
            "load_s": load_s,
            "drafter_errors": errors,
            "key_buckets": _key_buckets(),
            "row_products": _row_products(),
            "fused_projections": _fused(),
            "protocol": (
                "per mode: first = one request at a prompt length no request of this process had; then the "
                f"{len(seen_set)} held-out prompts twice (seen_once = the second pass, run prompt by prompt with "
                "every mode back to back; bench `runs`); warm = the "
                "first of them three more times: warm (plain timing), marked (each round timed: async_eval "
                "marks only), profiled (the device is waited for after each propose: drafter device time "
                "apart; perturbs the round). Every request starts from an empty cache, no prefix reuse."
            ),
            "breakdown_fields": BREAKDOWN_FIELDS,
            "modes": per_mode,
            "stopped_by_budget": budget.stopped,
        }
        return doc

    env = environment()
    services: dict[str, GenerationService] = {}

    def guarded(mode: str, body: Callable[..., None], *args: Any) -> None:
        entry = per_mode[mode]
        try:
            body(mode, entry, *args)
        except Exception as exc:  # keep going: one failing mode must not cost the slot
            entry["error"] = repr(exc)
            entry["traceback"] = traceback.format_exc()[-3000:]
            services.pop(mode, None)
            log(f"{mode}: FAILED {exc!r}")
        if on_progress is not None:
            on_progress(document())

    def set_up(mode: str, entry: dict[str, Any]) -> None:
        t0 = now()
        if mode == "auto":
            candidates = {PLAIN: None, **sources}
            plan = CalibrationPlan(depth=16, deep_depth=48, warmup=0, repeats=1, overhead_tokens=2, dense_widths=4)
            choice = measure_and_choose(
                _MemoryCalibrations(),
                model,
                candidates,
                clock,
                drafter_bits=drafter_bits,
                max_draft=max_draft,
                race_tokens=4 if smoke else 24,
                race_prompts=[p["ids"] for p in race] or None,
                plan=plan if smoke else None,
            )
            service = GenerationService(model, selector=choice.selector, clock=clock, telemetry=telemetry)
            selectors[mode] = choice.selector
            entry["race_tok_s"] = dict(choice.rates)
            entry["race_winner"] = choice.mode
            log(f"auto: race {', '.join(f'{k} {v:.1f}' for k, v in choice.rates.items())} tok/s -> {choice.mode}")
        elif mode.endswith("-stay") or _runs(mode)[1]:
            kind, late = _runs(mode)
            src = sources[kind]
            cap = min(max_draft or src.max_block, src.max_block)
            selector = _StaySelector(mode, src, cap, late)
            service = GenerationService(model, selector=selector, clock=clock, telemetry=telemetry)
        elif mode == PLAIN_CAPTURE:
            service = GenerationService(model, selector=_StaySelector(PLAIN_CAPTURE), clock=clock, telemetry=telemetry)
        else:
            src = sources.get(mode)
            factory = None if src is None else cap_policy_factory(max_draft, None, src.max_block)
            if src is not None and max_draft is None:
                from mlx_dspark.application.auto_mode import measured_cap_factory

                factory = measured_cap_factory(_MemoryCalibrations(), clock, model, mode, src)
            service = GenerationService(
                model, source=src, mode=mode, clock=clock, telemetry=telemetry, cap_policy_factory=factory
            )
        entry["setup_s"] = now() - t0
        if warmup:
            done = warm_up(service)
            entry["warmup"] = {"seconds": done.seconds, "requests": done.requests}
            log(f"{mode}: warm-up of {done.requests} requests in {done.seconds:.1f}s")
        p = first_prompt(rest + seen_set, target.prompt_lengths)
        r = request(service, p)
        entry["first_request"] = brief(p, r, mode)
        log(f"{mode}: first request {r.tokens_per_second:.1f} tok/s at {r.prompt_tokens} tokens")
        entry["new_to_mode"], entry["seen_once"] = [], []
        for p in () if smoke else seen_set:
            if budget.spent():
                break
            entry["new_to_mode"].append(brief(p, request(service, p), mode))
        services[mode] = service

    def seen_once(mode: str, entry: dict[str, Any], p: dict[str, Any]) -> None:
        r = request(services[mode], p)
        entry["seen_once"].append(brief(p, r, mode))
        runs.append(_run_record(mode, p, r))
        rounds_of[(mode, p["id"])] = telemetry.rounds

    def warm(mode: str, entry: dict[str, Any]) -> None:
        service = services[mode]
        log(f"{mode}: seen once {[round(x['decode_tok_s'], 1) for x in entry['seen_once']]} tok/s")
        if mode == "auto":
            for x in entry["new_to_mode"] + entry["seen_once"]:
                log(f"auto {x['prompt_id']}: rounds {x['source_rounds']}; " + " | ".join(x["switches"]))
                log(f"auto {x['prompt_id']} stints: {stints(x['trace'])}; priors after {x.get('priors_after')}")
        p = seen_set[0]
        if not smoke and not budget.spent():
            entry["warm"] = brief(p, request(service, p), mode)
        for name, barrier in (("marked", False), ("profiled", True)):
            if budget.spent():
                break
            with calls.recording(barrier=barrier):
                r = request(service, p)
            entry[name] = {**brief(p, r, mode), "breakdown": breakdown(calls.rounds())}
        if "warm" in entry:
            per_round = entry.get("marked", {}).get("breakdown")
            log(f"{mode}: warm {entry['warm']['decode_tok_s']:.1f} tok/s; per round {per_round}")

    # Set-up, warm-up, first request and the first pass per mode; then the seen-once pass prompt by prompt,
    # every mode back to back (a shared host's drift then moves all modes alike); then the warm runs per mode.
    for mode in order:
        if budget.spent():
            break
        per_mode[mode] = {"mode": mode}
        guarded(mode, set_up)
    for p in seen_set:
        for mode in [m for m in order if m in services]:
            if budget.spent():
                break
            guarded(mode, seen_once, p)
    for mode in [m for m in order if m in services]:
        guarded(mode, warm)
    doc = document()
    free_memory()
    return doc


# ------------------------------------------------------------------------------------------------------------
# The oracle: drafts the verify itself accepts for exactly τ positions.


def _filler(anchor: int, n: int, vocab: int) -> list[int]:
    state = (anchor * 0x9E3779B9 + 12345) & 0xFFFFFFFF
    out = []
    for _ in range(n):
        state = (state * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(state % vocab)
    return out


class ForcedAcceptanceOracle:
    """A draft source whose first τ drafts are what the target's verify at this round's width will choose,
    and whose draft τ+1 is a token that verify rejects: every round accepts exactly min(τ, cap) drafts.

    A plain-decoding reference does not force τ: a verify of k + 1 rows rounds differently from a one-row
    step. So the oracle asks the verify itself: it runs verify-shaped forwards of [anchor, d_1..d_cap] on the
    same cache (the target's own `verify`, then `commit(0)`, its exact rollback) and grows the chain d_1..d_τ
    one row per pass (rows are causal: row i depends on d_1..d_i only), reading row τ's choice to reject it.
    The passes cost τ + 1 verifies; callers exclude propose time from the round.
    """

    def __init__(self, target: Any, tau: int, *, max_block: int = 16) -> None:
        if tau < 0:
            raise ValueError("tau must be >= 0")
        self._target = target
        self.tau = tau
        self._max_block = max_block
        self.passes = 0
        self.seconds = 0.0
        self.unstable = 0  # passes whose verify disagreed with an earlier pass on the same rows

    @property
    def name(self) -> str:
        return "oracle"

    @property
    def max_block(self) -> int:
        return self._max_block

    @property
    def uses_features(self) -> bool:
        return False

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]) -> DraftBlock:
        if cap <= 0:
            return EMPTY_BLOCK
        t0 = now()
        vocab = int(self._target.vocab_size)
        want = min(self.tau, cap)
        fill = _filler(ctx.anchor, cap, vocab)
        known: list[int] = []
        reject: int | None = None
        while True:
            block = known + fill[len(known) : cap]
            verdict = self._target.verify(ctx.anchor, DraftBlock(tokens=tuple(block)), GREEDY, [0.5] * (cap + 1))
            self._target.commit(0)
            self.passes += 1
            if verdict.accepted < len(known):
                self.unstable += 1
            chain = [*block[: verdict.accepted], verdict.next_token]  # the verify's own choices, rows 0..accepted
            if len(chain) > want:
                known, reject = chain[:want], chain[want]
                break
            known = chain
            if len(known) >= cap:
                break
        drafts = known
        if want < cap:
            assert reject is not None
            drafts = [*known, (reject + 1) % vocab, *fill[want + 1 : cap]]
        self.seconds += now() - t0
        return DraftBlock(tokens=tuple(drafts), source=self.name)


VERIFY_SPLIT = ("verify_build_s", "dispatch_s", "readback_s", "commit_s")


def _split(calls: RoundCalls, keep: Sequence[bool]) -> dict[str, float | None]:
    """Medians of the recorded verify calls' host build / dispatch / readback / commit, rounds where `keep`."""
    rounds = [r for r, k in zip(calls.rounds(), keep) if k]
    return {key: _median([r[key] for r in rounds]) for key in VERIFY_SPLIT}


def forced_run(target: Any, prompt: Sequence[int], tau: int, cap: int, tokens: int) -> dict[str, Any]:
    """One request of `tokens` greedy tokens under the oracle at (τ, cap), every round timed.

    The decode loop's verify and commit are also split into host graph building, dispatch and readback
    (async_eval marks); the oracle's own passes go to the bare target and are not recorded.
    """
    oracle = ForcedAcceptanceOracle(target, tau, max_block=max(cap, 1))
    calls = RoundCalls()
    timed = TimedTarget(target, calls)
    rows: list[dict[str, Any]] = []
    out: list[int] = []
    target.reset(0)
    with calls.recording(barrier=False):
        _forced_rounds(timed, oracle, prompt, cap, StopRule(max_tokens=tokens, eos_ids=frozenset()), rows, out)
    full = [r for r in rows if r["cap"] == cap]  # budget-end rounds draft less
    want = min(tau, cap)
    tokens_per_round = statistics.fmean(r["committed"] for r in full) if full else None
    round_s = _median([r["round_s"] for r in full])
    return {
        "tau": tau,
        "cap": cap,
        "ideal_tokens_per_round": want + 1,
        "forced": all(r["accepted"] == min(tau, r["cap"]) for r in rows) and bool(rows),
        "rounds": len(rows),
        "full_rounds": len(full),
        "tokens_per_round": tokens_per_round,
        "round_s": round_s,
        "round_s_mean": statistics.fmean(r["round_s"] for r in full) if full else None,
        "verify_commit_s": _median([r["verify_s"] for r in full]),
        **_split(calls, [r["cap"] == cap for r in rows]),
        "oracle_passes": oracle.passes,
        "oracle_s": oracle.seconds,
        "oracle_unstable_passes": oracle.unstable,
        "generated": len(out),
        "token_ids": out,
        "per_round": rows,
    }


def _forced_rounds(
    target: Any,
    oracle: ForcedAcceptanceOracle,
    prompt: Sequence[int],
    cap: int,
    stop: StopRule,
    rows: list[dict[str, Any]],
    out: list[int],
) -> None:
    """The decode loop under the oracle; each round's wall time, acceptance and the loop's own split."""
    last: float | None = None
    for ev in decode(target, prompt, GREEDY, stop, _Clock(), source=oracle, cap_policy=FixedCap(cap)):
        if isinstance(ev, TokensCommitted):
            out.extend(ev.tokens)
            if last is None:
                last = now()
        elif isinstance(ev, RoundFinished):
            t = now()
            wall = t - (last if last is not None else t)
            last = t
            rows.append(
                {
                    "cap": ev.cap,
                    "accepted": ev.accepted,
                    "committed": ev.committed,
                    "wall_s": wall,
                    "draft_s": ev.draft_s,
                    "verify_s": ev.verify_s,
                    "round_s": wall - ev.draft_s,
                }
            )


def plain_run(target: Any, prompt: Sequence[int], tokens: int, *, split: bool = False) -> dict[str, Any]:
    """Plain decoding through the decode loop (pipelined steps): the median step and the decode rate, and
    with `split` each step's host build (of the queued next step) / dispatch / readback."""
    target.reset(0)
    calls = RoundCalls()
    steps: list[float] = []
    out: list[int] = []
    last: float | None = None
    usage = None
    stop = StopRule(max_tokens=tokens, eos_ids=frozenset())
    with calls.recording(barrier=False) if split else contextlib.nullcontext():
        for ev in decode(TimedTarget(target, calls), prompt, GREEDY, stop, _Clock()):
            if isinstance(ev, TokensCommitted):
                out.extend(ev.tokens)
                if last is None:
                    last = now()
            elif isinstance(ev, RoundFinished):
                t = now()
                steps.append(t - (last if last is not None else t))
                last = t
            elif isinstance(ev, Finished):
                usage = ev.usage
    rate = (usage.generated_tokens - 1) / usage.decode_s if usage and usage.decode_s > 0 else None
    return {
        "step_s": _median(steps),
        "tok_s": rate,
        "token_ids": out,
        **(_split(calls, [True] * len(steps)) if split else {}),
    }


# ------------------------------------------------------------------------------------------------------------
# Synthetic targets from random weights, built on the device.

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "0.6b": (
        "qwen3",
        {
            "hidden_size": 1024,
            "num_hidden_layers": 28,
            "intermediate_size": 3072,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
        },
    ),
    "4b": (
        "qwen3",
        {
            "hidden_size": 2560,
            "num_hidden_layers": 36,
            "intermediate_size": 9728,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
        },
    ),
    "8b": (
        "qwen3",
        {
            "hidden_size": 4096,
            "num_hidden_layers": 36,
            "intermediate_size": 12288,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
        },
    ),
    "32b": (
        "qwen2",
        {
            "hidden_size": 5120,
            "num_hidden_layers": 64,
            "intermediate_size": 27648,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "vocab_size": 152064,
            "tie_word_embeddings": False,
        },
    ),
    # An approximate Qwen3.5-4B-sized hybrid: three gated-DeltaNet layers per attention layer.
    "hybrid": (
        "qwen3_5",
        {
            "text_config": {
                "model_type": "qwen3_5_text",
                "hidden_size": 2560,
                "num_hidden_layers": 32,
                "intermediate_size": 9216,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "head_dim": 256,
                "full_attention_interval": 4,
                "linear_num_key_heads": 16,
                "linear_num_value_heads": 32,
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
                "linear_conv_kernel_dim": 4,
                "vocab_size": 248320,
                "tie_word_embeddings": True,
            }
        },
    ),
}
_COMMON = {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}


def shape_config(shape: str, *, tiny: bool = False) -> tuple[str, dict[str, Any]]:
    """(mlx-lm model_type, config) of a named shape; `tiny` keeps its family and layer pattern at hidden 64."""
    family, cfg = SHAPES[shape]
    if family == "qwen3_5":
        text = {**_COMMON, **cfg["text_config"]}
        if tiny:
            text |= TINY | {
                "num_hidden_layers": 4,
                "head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
            }
        return family, {"model_type": family, "text_config": text}
    full = {"model_type": family, **_COMMON, **cfg}
    if tiny:
        full |= TINY | {"num_hidden_layers": 2} | ({"head_dim": 16} if "head_dim" in full else {})
    return family, full


def param_count(model: Any) -> int:
    return sum(int(math.prod(v.shape)) for _, v in tree_flatten(model.parameters()))


def random_model(family: str, config: dict[str, Any], dtype: Any, seed: int = 0) -> Any:
    """An mlx-lm model of `config` with random weights drawn on the default device in `dtype`.

    Matrices get N(0, 1/fan_in) (fan_in = every axis but the first), so each projection keeps its input's
    scale and activations stay finite through any depth; vectors (norms, biases, gates) keep mlx-lm's init,
    cast. The module's own lazy init is replaced before it is ever evaluated, so nothing is materialised in
    float32; weights are evaluated a layer at a time to bound the peak.
    """
    module = importlib.import_module(f"mlx_lm.models.{family}")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = tree_flatten(model.parameters())
    groups: dict[str, list[tuple[str, Any]]] = {}
    for name, p in params:
        parts = name.split(".")
        key = ".".join(parts[: parts.index("layers") + 2]) if "layers" in parts else parts[0]
        if p.ndim >= 2:
            fan_in = int(math.prod(p.shape[1:]))
            new = mx.random.normal(p.shape, dtype=dtype, scale=fan_in**-0.5)
        else:
            new = p.astype(dtype)
        groups.setdefault(key, []).append((name, new))
    del params
    for group in groups.values():
        model.update(tree_unflatten(group))
        mx.eval([a for _, a in group])
    model.eval()
    return model


def run_shape(
    shape: str,
    dtype_name: str,
    *,
    taus: Sequence[int],
    tokens: int,
    prompt_tokens: int,
    tiny: bool,
    budget: Budget,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Plain step and forced-τ rounds of one random-weight shape in one dtype."""
    dtype = {
        "bf16": mx.bfloat16,
        "bfloat16": mx.bfloat16,
        "fp32": mx.float32,
        "float32": mx.float32,
        "fp16": mx.float16,
        "float16": mx.float16,
    }[dtype_name]
    family, cfg = shape_config(shape, tiny=tiny)
    row: dict[str, Any] = {"shape": shape, "family": family, "dtype": dtype_name, "tiny": tiny}
    t0 = now()
    module = importlib.import_module(f"mlx_lm.models.{family}")
    probe = module.Model(module.ModelArgs.from_dict(cfg))  # lazy: nothing is allocated
    params = param_count(probe)
    del probe
    bytes_needed = params * dtype.size
    row |= {"params": params, "weight_bytes": bytes_needed}
    if bytes_needed > 0.8 * device_memory_bytes():
        row["skipped"] = f"{bytes_needed / 2**30:.1f} GiB of weights do not fit"
        return row
    model = random_model(family, cfg, dtype)
    target = MlxTargetModel(model)
    vocab = target.vocab_size
    prompt = synthetic_prompt(prompt_tokens, vocab, seed=7)
    logits = model(mx.array([prompt[:16]]))
    row["logits_finite"] = bool(mx.isfinite(logits).all().item())
    row["logits_std"] = float(mx.std(logits[0, -1].astype(mx.float32)).item())
    row["build_s"] = now() - t0
    log(f"{shape} {dtype_name}: {params / 1e9:.2f}B params built in {row['build_s']:.1f}s")
    plain_run(target, prompt, 8)  # warm-up: this shape's kernels
    plain = plain_run(target, prompt, tokens)
    row["plain_step_s"], row["plain_tok_s"] = plain["step_s"], plain["tok_s"]
    marked = plain_run(target, prompt, tokens, split=True)  # a second pass: the marks cost a little
    row["plain_split"] = {k: marked[k] for k in VERIFY_SPLIT}
    log(f"{shape} {dtype_name}: plain step {1e3 * (plain['step_s'] or 0):.2f} ms")
    forced: list[dict[str, Any]] = []
    row["forced"] = forced
    for tau in taus:
        for cap in dict.fromkeys((7, tau + 1)):
            if budget.spent():
                row["stopped_by_budget"] = True
                break
            run = forced_run(target, prompt, tau, cap, tokens)
            step, rnd = row["plain_step_s"], run["round_s"]
            run["round_per_step"] = rnd / step if rnd and step else None
            run["efficiency"] = step / rnd if rnd and step else None
            run["speedup"] = run["tokens_per_round"] * step / rnd if rnd and step and run["tokens_per_round"] else None
            run.pop("token_ids")
            run.pop("per_round")
            forced.append(run)
            log(
                f"{shape} {dtype_name} tau {tau} cap {cap}: {run['tokens_per_round']} tok/round, "
                f"round {1e3 * (rnd or 0):.2f} ms, speedup {run['speedup']}, forced {run['forced']}"
            )
    forced.sort(key=lambda r: (r["tau"], r["cap"]))
    goal = [r for r in forced if r["tau"] == 4]
    row["goal_tau4"] = {
        "goal_speedup": 3.0,
        "speedup_cap7": next((r["speedup"] for r in goal if r["cap"] == 7), None),
        "speedup_cap5": next((r["speedup"] for r in goal if r["cap"] == 5), None),
    }
    del target, model
    free_memory()
    return row


def run_synthetic(
    shapes: Sequence[str],
    dtypes: Sequence[str],
    *,
    taus: Sequence[int],
    tokens: int = 64,
    prompt_tokens: int = 128,
    tiny: bool = False,
    budget: Budget | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    budget = budget or Budget(math.inf)
    rows: list[dict[str, Any]] = []

    def section() -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "settings": {"taus": list(taus), "tokens": tokens, "prompt_tokens": prompt_tokens, "tiny": tiny},
            "round_time": ROUND_TIME,
            "speedup": "tokens per round x plain step / round (plain decoding pipelines its steps, as in use)",
            "efficiency": "plain step / round: the share of the ideal (tau+1 tokens for one step's cost) reached",
            "shapes": rows,
            "stopped_by_budget": budget.stopped,
        }

    for shape in shapes:
        for dtype in dtypes:
            if budget.spent():
                break
            try:
                rows.append(
                    run_shape(
                        shape,
                        dtype,
                        taus=taus,
                        tokens=tokens,
                        prompt_tokens=prompt_tokens,
                        tiny=tiny,
                        budget=budget,
                        log=log,
                    )
                )
            except Exception as exc:  # keep going: one shape must not cost the slot
                failure = {"error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
                rows.append({"shape": shape, "dtype": dtype, **failure})
                log(f"{shape} {dtype}: FAILED {exc!r}")
                free_memory()
            if on_progress is not None:
                on_progress(section())
    return section()


# ------------------------------------------------------------------------------------------------------------
# Tables.


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _key_buckets() -> bool | str:
    """Whether this run's wide forwards attended over padded key buckets (MLX_DSPARK_KEY_BUCKETS)."""
    try:
        from mlx_dspark.adapters.mlx import key_buckets

        return key_buckets.enabled()
    except (ImportError, ValueError) as exc:
        return repr(exc)


def _row_products() -> bool | str:
    """Whether this run's few-row projections ran as row products (MLX_DSPARK_ROW_PRODUCTS), and for which weight
    dtypes the few-row kernel passed its check (after the models loaded)."""
    try:
        from mlx_dspark.adapters.mlx import row_products

        on = row_products.enabled()
        kernel = [str(d).removeprefix("mlx.core.") for d, ok in row_products._skinny_ok.items() if ok]
        return f"{on}, few-row kernel: {', '.join(kernel) or 'none'}" if on else on
    except (ImportError, ValueError) as exc:
        return repr(exc)


def _fused() -> bool | str:
    """Whether this run's targets fused q/k/v and gate/up (MLX_DSPARK_FUSE)."""
    try:
        from mlx_dspark.adapters.mlx import fused_projections

        return fused_projections.enabled()
    except (ImportError, ValueError) as exc:
        return repr(exc)


def real_table(doc: dict[str, Any]) -> str:
    bench = doc.get("device_bench", {})
    speed = {m["mode"]: m for m in doc.get("modes", [])}
    lines = [
        f"Real model `{doc.get('model')}` ({bench.get('dtype')}), {doc.get('settings', {}).get('max_tokens')} "
        f"tokens, cap {bench.get('max_draft') or 'measured'}, key buckets {bench.get('key_buckets')}, "
        f"row products {bench.get('row_products')}, fused projections {bench.get('fused_projections')}; tok/s; "
        "per-round ms: medians of the marked (and profiled) runs.",
        "",
        "| mode | first request | seen once (min-median-max) | warm | x plain (seen once) | accepted/round "
        "| round ms | host ms | readback ms | drafter device ms (profiled) | verify device ms (profiled) "
        "| same as plain | divergences near-tie |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for mode, m in bench.get("modes", {}).items():
        if "error" in m:
            lines.append(f"| {mode} | error: {m['error'][:80]} |" + " |" * 12)
            continue
        seen = m.get("seen_once_decode_tok_s") or {}
        mk = (m.get("marked") or {}).get("breakdown", {})
        pf = (m.get("profiled") or {}).get("breakdown", {})
        same = m.get("identical_to_plain") or {}
        parted = [d for d in (m.get("divergences") or {}).values() if d is not None]
        ties = f"{sum(d.get('near_tie') is True for d in parted)}/{len(parted)}" if parted else "-"
        lines.append(
            f"| {mode} | {_f((m.get('first_request') or {}).get('decode_tok_s'), '.1f')} "
            f"| {_f(seen.get('min'), '.1f')}-{_f(seen.get('median'), '.1f')}-{_f(seen.get('max'), '.1f')} "
            f"| {_f((m.get('warm') or {}).get('decode_tok_s'), '.1f')} | {_f(speed.get(mode, {}).get('speedup'))} "
            f"| {_f(speed.get(mode, {}).get('mean_accepted'))} | {_ms(mk.get('round_s'))} | {_ms(mk.get('host_s'))} "
            f"| {_ms(mk.get('readback_s'))} | {_ms(pf.get('drafter_device_s'))} | {_ms(pf.get('readback_s'))} "
            f"| {sum(same.values())}/{len(same)} | {ties} |"
        )
    return "\n".join(lines) + "\n"


def _host(r: dict[str, Any]) -> float | None:
    parts = [r.get(k) for k in ("verify_build_s", "dispatch_s", "commit_s")]
    return None if any(x is None for x in parts) else sum(parts)  # type: ignore[arg-type]


def synthetic_table(section: dict[str, Any]) -> str:
    lines = [
        f"Random-weight targets, oracle-forced acceptance, {section['settings']['tokens']} tokens; round = "
        f"{section['round_time']}.",
        "",
        "| shape | dtype | plain step ms | tau | cap | tokens/round | round ms | host ms | readback ms | round/step "
        "| speedup | ideal | efficiency | forced |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    goals = []
    for s in section["shapes"]:
        if "error" in s or "skipped" in s:
            lines.append(f"| {s['shape']} | {s['dtype']} | {s.get('error') or s.get('skipped')} |" + " |" * 11)
            continue
        for r in s.get("forced", []):
            lines.append(
                f"| {s['shape']} | {s['dtype']} | {_ms(s.get('plain_step_s'))} | {r['tau']} | {r['cap']} "
                f"| {_f(r['tokens_per_round'])} | {_ms(r['round_s'])} | {_ms(_host(r))} | {_ms(r.get('readback_s'))} "
                f"| {_f(r['round_per_step'])} "
                f"| {_f(r['speedup'])} | {r['ideal_tokens_per_round']} | {_f(r['efficiency'])} | {r['forced']} |"
            )
        g = s.get("goal_tau4") or {}
        cap7, cap5 = _f(g.get("speedup_cap7")), _f(g.get("speedup_cap5"))
        goals.append(f"{s['shape']} {s['dtype']}: {cap7}x (cap 7), {cap5}x (cap 5)")
    if goals:
        lines += ["", "tau = 4 speedup vs plain (goal >= 3.0x): " + "; ".join(goals)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="CPU side: the default model (or --gguf) as an exact export + encoded prompts")
    e.add_argument("--gguf", type=Path)
    e.add_argument("--out", type=Path, required=True)
    for name in ("real", "synthetic", "all"):
        s = sub.add_parser(name)
        s.add_argument("--json", type=Path)
        s.add_argument("--table", type=Path)
        s.add_argument("--smoke", action="store_true", help="everything tiny, a few seconds: catches import errors")
        if name in ("real", "all"):
            s.add_argument("--model", type=Path, required=True, help="the export (or an mlx-lm directory)")
            s.add_argument("--modes", default=",".join(MODES))
            s.add_argument("--model-dtype", default="bfloat16", help="bfloat16, float16, float32 or quantized")
            s.add_argument("--max-tokens", type=int, default=128)
            s.add_argument("--prompts", type=int, default=3, help="held-out prompts seen once (one per class)")
            s.add_argument("--max-draft", default="7", help="an integer, or auto (the calibrated cap policy)")
            s.add_argument("--drafter-bits", type=int, default=None)
            s.add_argument("--warmup", action="store_true", help="each mode runs the server's warm-up first")
            s.add_argument("--dspark", type=Path, help="DSpark checkpoint (default: the shipped one)")
            s.add_argument("--dflash", type=Path, help="DFlash checkpoint (default: the shipped one)")
            s.add_argument("--real-budget-seconds" if name == "all" else "--budget-seconds", type=float, default=210)
        if name in ("synthetic", "all"):
            s.add_argument("--shapes", default="4b,32b,0.6b,8b,hybrid", help="run in this order (goal shapes first)")
            s.add_argument("--dtype", default="bf16", help="comma-separated: bf16, fp16, fp32")
            s.add_argument("--taus", default="4,1,7,2,3,5,6", help="run in this order; reported sorted")
            s.add_argument("--tokens", type=int, default=64)
            s.add_argument("--prompt-tokens", type=int, default=128)
            s.add_argument(
                "--synthetic-budget-seconds" if name == "all" else "--budget-seconds", type=float, default=170
            )
    return p


def main(argv: Sequence[str] | None = None, *, clock: Callable[[], float] = now) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "export":
        print(json.dumps(export(args.gguf, args.out), indent=1))
        return 0
    doc: dict[str, Any] = {"schema": SCHEMA}
    tables: dict[str, str] = {}
    env: dict[str, Any] = {}

    def save(part: str, value: dict[str, Any]) -> None:
        if part == "real":
            extra = {k: v for k, v in doc.items() if k == "synthetic"}
            doc.clear()
            doc.update(value | extra)
            tables["real"] = real_table(value)
        else:
            doc["synthetic"] = value
            if "environment" not in doc:
                env.update(env or environment())
                doc["environment"] = env
            tables["synthetic"] = synthetic_table(value)
        write_atomic(args.json, json.dumps(doc, indent=1, default=str))
        write_atomic(args.table, "\n".join(tables.values()))

    if args.cmd in ("real", "all"):
        seconds = args.budget_seconds if args.cmd == "real" else args.real_budget_seconds
        drafters = {k: getattr(args, k) for k in ("dspark", "dflash") if getattr(args, k) is not None}
        max_draft = None if str(args.max_draft).lower() == "auto" else int(args.max_draft)
        try:
            real = run_real(
                args.model,
                dtype=args.model_dtype,
                modes=[m.strip() for m in args.modes.split(",") if m.strip()],
                max_tokens=6 if args.smoke else args.max_tokens,
                seen_prompts=1 if args.smoke else args.prompts,
                max_draft=max_draft,
                drafter_bits=args.drafter_bits,
                drafters=drafters,
                smoke=args.smoke,
                warmup=args.warmup,
                budget=Budget(seconds, clock),
                on_progress=lambda d: save("real", d),
            )
        except Exception as exc:  # the synthetic half still runs (`all`): nothing here needs the export
            traceback.print_exc()
            real = {"schema": SCHEMA, "device_bench": {"error": repr(exc), "traceback": traceback.format_exc()}}
            if args.cmd == "real":
                save("real", real)
                return 1
        save("real", real)
    if args.cmd in ("synthetic", "all"):
        seconds = args.budget_seconds if args.cmd == "synthetic" else args.synthetic_budget_seconds
        section = run_synthetic(
            [s.strip() for s in args.shapes.split(",") if s.strip()],
            [d.strip() for d in args.dtype.split(",") if d.strip()] if not args.smoke else ["fp32", "bf16"],
            taus=_ints(args.taus) if not args.smoke else [1, 2],
            tokens=16 if args.smoke else args.tokens,
            prompt_tokens=16 if args.smoke else args.prompt_tokens,
            tiny=args.smoke,
            budget=Budget(seconds, clock),
            on_progress=lambda s: save("synthetic", s),
        )
        save("synthetic", section)
    print("\n".join(tables.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
