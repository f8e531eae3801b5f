"""mlx-lm's `generate_step` as the bench's reference, on tiny mlx-lm models: greedy, it produces exactly our
plain decoding's token ids (an EOS ends both at the same place), and `bench --against mlx-lm` and
`--prefill-lengths` report it beside ours from real runs on the same model object."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import pytest

from mlx_dspark.adapters.mlx.mlx_lm_reference import MlxLmReference, reference_generate
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application import bootstrap
from mlx_dspark.application.engine import decode
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.events import TokensCommitted
from mlx_dspark.domain.ports import DraftSource
from mlx_dspark.domain.tokens import SamplingParams, StopRule
from mlx_dspark.entrypoints.cli import bench
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.tiny_models import VOCAB, tiny_model
from tests.integration.calibration.timed_fakes import ByteTokenizer, MemoryStore

PROMPT = [3, 17, 99, 5, 42, 7, 1, 150, 64, 12]


@functools.cache
def model(family: str) -> Any:
    return tiny_model(family, seed=1)


def ours(target: MlxTargetModel, prompt: Sequence[int], n: int, eos: frozenset[int] = frozenset()) -> list[int]:
    target.reset(0)
    out: list[int] = []
    for ev in decode(target, list(prompt), SamplingParams(), StopRule(max_tokens=n, eos_ids=eos), FakeClock()):
        if isinstance(ev, TokensCommitted):
            out.extend(ev.tokens)
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_mlx_lm_greedy_equals_our_plain_decoding(family: str) -> None:
    handle = model(family)
    mine = ours(MlxTargetModel(handle), PROMPT, 24)
    theirs = reference_generate(handle, PROMPT, max_tokens=24, clock=FakeClock())
    assert list(theirs.token_ids) == mine and len(mine) == 24
    assert theirs.prefill_s > 0 and theirs.decode_s > 0 and theirs.tokens_per_second > 0
    # An EOS ends both before it, at the same place.
    eos = frozenset({mine[5]})
    cut = ours(MlxTargetModel(handle), PROMPT, 24, eos)
    assert list(reference_generate(handle, PROMPT, max_tokens=24, eos_ids=eos).token_ids) == cut
    assert cut == mine[: mine.index(mine[5])]


class TinyLoader:
    """The ModelLoader port over a tiny llama (bytes of the text as token ids) and n-gram lookup."""

    def __init__(self) -> None:
        handle = model("llama")
        self.model = LoadedModel(
            name="tiny-llama",
            identity="tiny/llama@seed1",
            target=MlxTargetModel(handle),
            tokenizer=ByteTokenizer(VOCAB),
            context_window=4096,
            family="llama",
            handle=handle,
        )

    def load_target(self, name: str) -> LoadedModel:
        return self.model

    def load_drafter(self, kind: str, spec: str | None, model: LoadedModel, *, bits: int | None) -> DraftSource:
        return LookupDraftSource(block=4)

    def available_drafters(self, model: LoadedModel) -> list[str]:
        return ["lookup"]

    def drafter_kind(self, spec: str) -> str | None:
        return None


@pytest.fixture
def tiny_bench(monkeypatch: pytest.MonkeyPatch) -> TinyLoader:
    loader = TinyLoader()
    settings = load_settings({"model": "tiny", "max_draft": "4"}, {})
    services = bootstrap.build(
        settings, loader=loader, telemetry=RecordingTelemetrySink(), calibration=MemoryStore()
    )
    monkeypatch.setattr(bench, "start_with_model", lambda *_a: (settings, services, loader.model))
    return loader


def test_bench_against_mlx_lm_reports_identical_ids_and_ratios(
    tiny_bench: TinyLoader, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat on the mat and the cat sat\nabcabcabcabc\n")
    argv = ["--against", "mlx-lm", "--modes", "baseline,lookup", "--prompts", str(prompts), "--trials", "1",
            "--max-tokens", "8", "--quiet"]  # fmt: skip
    assert bench.main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["reference"] == "mlx-lm"
    by = {m["mode"]: m for m in doc["modes"]}
    assert list(by) == ["baseline", "mlx-lm", "lookup"]
    assert by["mlx-lm"]["lossless"] is True and by["mlx-lm"]["first_divergence"] == {}
    for m in by.values():
        assert m["prefill_tok_s"] > 0 and m["decode_tok_s"] > 0
        assert m["decode_vs_reference"] > 0 and m["prefill_vs_reference"] > 0
    ref_runs = [r for r in doc["runs"] if r["mode"] == "mlx-lm"]
    assert len(ref_runs) == 2 and all(r["generated_tokens"] == 8 for r in ref_runs)
    assert [r["mode"] for r in doc["runs"]] == ["baseline", "mlx-lm", "lookup"] * 2  # paired per prompt
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    assert "decode/mlx-lm" in table and table.splitlines()[4].startswith("mlx-lm")


def test_prefill_lengths_time_ours_against_mlx_lm(tiny_bench: TinyLoader, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--prefill-lengths", "16,64", "--trials", "2", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prefill"]["reference"] == "mlx-lm"
    points = doc["prefill"]["points"]
    assert [p["tokens"] for p in points] == [16, 64]
    for p in points:
        assert p["same_first_token"] is True
        assert len(p["ours_s"]) == len(p["reference_s"]) == 2
        assert p["prefill_tok_s"] > 0 and p["reference_prefill_tok_s"] > 0 and p["prefill_vs_reference"] > 0
        # The real target counts its GEMM work and times its own GEMM: the limit is reported beside ours.
        assert p["gemm_bound_tok_s"] > 0
        assert p["prefill_vs_gemm_bound"] == pytest.approx(p["prefill_tok_s"] / p["gemm_bound_tok_s"])
    assert bench.main(["--prefill-lengths", "32", "--trials", "1", "--quiet"]) == 0
    table = capsys.readouterr().out
    assert "ours/mlx-lm" in table and "ours/bound" in table


def test_the_reference_port_needs_an_mlx_lm_module() -> None:
    loaded = TinyLoader().model
    import attrs

    with pytest.raises(TypeError, match="no mlx-lm module"):
        MlxLmReference().generate(attrs.evolve(loaded, handle=None), PROMPT, max_tokens=2, eos_ids=frozenset(),
                                  clock=FakeClock())  # fmt: skip
