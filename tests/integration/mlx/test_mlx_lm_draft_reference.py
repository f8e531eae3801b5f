"""mlx-lm's draft-model speculation (`speculative_generate_step`) as a bench reference, on a tiny llama target
and tiny drafts sharing its vocabulary: greedy, it produces exactly our plain decoding's ids at every draft
length; `bench --against mlx-lm-draft --num-draft ...` reports one paired row per length from real runs and
headlines the fastest; a draft that does not share the target's vocabulary, or no draft model at all, is a
clear error."""

from __future__ import annotations

import functools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import attrs
import pytest

from mlx_dspark.adapters.mlx.draft_model import DraftModelSource
from mlx_dspark.adapters.mlx.mlx_lm_reference import MlxLmDraftReference, reference_speculative_generate
from mlx_dspark.adapters.mlx.target import MlxTargetModel
from mlx_dspark.application import bootstrap
from mlx_dspark.application.lab.references import (
    check_shared_vocabulary,
    draft_model_name,
    num_draft_values,
    reference_kinds,
)
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.drafting.lookup import LookupDraftSource
from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.ports import DraftSource
from mlx_dspark.entrypoints.cli import bench
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.tiny_models import VOCAB, tiny_model
from tests.integration.calibration.timed_fakes import ByteTokenizer, MemoryStore
from tests.integration.mlx.test_mlx_lm_reference import PROMPT, model, ours


@functools.cache
def draft_handle(layers: int = 1, vocab: int = VOCAB) -> Any:
    """Another random llama (other seed, fewer layers): it drafts badly, so rounds accept a mix."""
    return tiny_model("llama", seed=7, num_hidden_layers=layers, vocab_size=vocab)


@pytest.mark.parametrize("num_draft", [1, 3, 6])
def test_draft_speculation_is_our_plain_greedy_decoding(num_draft: int) -> None:
    handle = model("llama")
    mine = ours(MlxTargetModel(handle), PROMPT, 24)
    got = reference_speculative_generate(handle, draft_handle(), PROMPT, num_draft=num_draft, max_tokens=24,
                                         clock=FakeClock())  # fmt: skip
    assert list(got.token_ids) == mine and len(mine) == 24
    assert got.rounds is not None and math.ceil(24 / (num_draft + 1)) <= got.rounds <= 24
    assert got.prefill_s > 0 and got.decode_s > 0
    # An EOS ends it before the EOS, where ours ends.
    eos = frozenset({mine[5]})
    cut = ours(MlxTargetModel(handle), PROMPT, 24, eos)
    again = reference_speculative_generate(handle, draft_handle(), PROMPT, num_draft=num_draft, max_tokens=24,
                                           eos_ids=eos)  # fmt: skip
    assert list(again.token_ids) == cut == mine[: mine.index(mine[5])]


def test_a_perfect_draft_is_accepted_whole_and_the_budget_cuts_the_last_round() -> None:
    handle = model("llama")
    got = reference_speculative_generate(handle, handle, PROMPT, num_draft=3, max_tokens=10)
    assert list(got.token_ids) == ours(MlxTargetModel(handle), PROMPT, 10)
    assert got.rounds == 3  # 4 + 4 + 2 tokens: every draft accepted, the third round cut to the budget


class PairLoader:
    """The ModelLoader port over a tiny llama target ("tiny") and drafts for it by name."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.models = {
            "tiny": self._loaded("tiny", model("llama")),
            "tiny-draft": self._loaded("tiny-draft", draft_handle()),
            "narrow-draft": self._loaded("narrow-draft", draft_handle(1, VOCAB - 32)),
            "other-tokenizer": self._loaded("other-tokenizer", draft_handle(), ShiftedTokenizer(VOCAB)),
        }
        self.loaded: list[str] = []

    @staticmethod
    def _loaded(name: str, handle: Any, tokenizer: Any = None) -> LoadedModel:
        return LoadedModel(
            name=name,
            identity=f"tiny/{name}",
            target=MlxTargetModel(handle),
            tokenizer=tokenizer or ByteTokenizer(VOCAB),
            context_window=4096,
            family="llama",
            handle=handle,
        )

    def load_target(self, name: str) -> LoadedModel:
        self.loaded.append(name)
        return self.models[name]

    def load_drafter(self, kind: str, spec: str | None, model: LoadedModel, *, bits: int | None) -> DraftSource:
        return LookupDraftSource(block=4)

    def draft_model_source(self, draft: LoadedModel) -> DraftSource:
        return DraftModelSource(draft.handle, identity=draft.identity)

    def available_drafters(self, model: LoadedModel) -> list[str]:
        return ["lookup"]

    def drafter_kind(self, spec: str) -> str | None:
        return None


class ShiftedTokenizer(ByteTokenizer):
    """Same size, other ids: a tokenizer that does not agree with ByteTokenizer."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [(b + 1) % self.vocab_size for b in text.encode("utf-8")]


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> PairLoader:
    loader = PairLoader()
    settings = load_settings({"model": "tiny", "max_draft": "4"}, {})
    services = bootstrap.build(settings, loader=loader, telemetry=RecordingTelemetrySink(), calibration=MemoryStore())
    monkeypatch.setattr(bench, "start_with_model", lambda *_a: (settings, services, loader.models["tiny"]))
    return loader


def _prompts(tmp_path: Path) -> str:
    path = tmp_path / "prompts.txt"
    path.write_text("the cat sat on the mat and the cat sat\nabcabcabcabc\n")
    return str(path)


def test_bench_against_mlx_lm_draft_pairs_a_row_per_draft_length(
    pair: PairLoader, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--against", "mlx-lm,mlx-lm-draft", "--draft-model", "tiny-draft", "--num-draft", "4,2",
            "--modes", "baseline,lookup", "--prompts", _prompts(tmp_path), "--trials", "1", "--max-tokens", "12",
            "--quiet"]  # fmt: skip
    assert bench.main([*argv, "--json"]) == 0
    assert pair.loaded == ["tiny-draft"]
    doc = json.loads(capsys.readouterr().out)
    refs = ["mlx-lm", "mlx-lm-draft@2", "mlx-lm-draft@4"]
    assert doc["schema"] == "mlx-dspark/bench/5" and doc["references"] == refs
    by = {m["mode"]: m for m in doc["modes"]}
    assert list(by) == ["baseline", *refs, "lookup"]
    assert doc["reference"] == max(refs, key=lambda r: by[r]["decode_tok_s"])  # the headline: the fastest
    assert [r["mode"] for r in doc["runs"]] == ["baseline", *refs, "lookup"] * 2  # paired per prompt
    for r in refs:
        assert by[r]["lossless"] is True and by[r]["first_divergence"] == {}
    for name in ("mlx-lm-draft@2", "mlx-lm-draft@4"):
        runs = [r for r in doc["runs"] if r["mode"] == name]
        assert all(r["generated_tokens"] == 12 for r in runs)
        assert 1.0 <= by[name]["mean_accepted"] <= int(name.rsplit("@")[1]) + 1
    for m in by.values():
        assert set(m["vs_references"]) == set(refs)
        head = m["vs_references"][doc["reference"]]
        assert m["decode_vs_reference"] == head["decode"] > 0 and m["prefill_vs_reference"] == head["prefill"]
        assert m["per_class_decode_vs_reference"] == head["per_class_decode"]
        mine = {r["prompt_id"]: r["decode_tok_s"] for r in doc["runs"] if r["mode"] == m["mode"]}
        for name in refs:  # each ratio is ours ÷ that reference, paired on the same prompt
            theirs = {r["prompt_id"]: r["decode_tok_s"] for r in doc["runs"] if r["mode"] == name}
            expected = statistics.median(mine[p] / theirs[p] for p in mine)
            assert m["vs_references"][name]["decode"] == pytest.approx(expected)
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    assert "decode/mlx-lm-draft@2" in table and "decode/mlx-lm-draft@4" in table
    assert f"the fastest reference is {doc['reference']}" in table
    assert [line.split()[0] for line in table.splitlines()[3:8]] == ["baseline", *refs, "lookup"]


def _stderr_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert bench.main(argv) == 1
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--against", "mlx-lm-draft"], "needs --draft-model NAME|DIR: model 'tiny' has no default draft model"),
        (["--against", "mlx-lm-draft", "--draft-model", "narrow-draft"], "does not share the vocabulary"),
        (["--against", "mlx-lm-draft", "--draft-model", "other-tokenizer"], "tokenizes differently"),
        (["--against", "mlx-lm-draft", "--draft-model", "tiny-draft", "--num-draft", "0"], "positive integers"),
        (["--against", "mlx-lm-drafts"], "--against takes mlx-lm or mlx-lm-draft"),
        (["--against", "mlx-lm", "--num-draft", "4"], "goes with --against mlx-lm-draft"),
        (["--against", "mlx-lm-draft", "--draft-model", "tiny-draft", "--temperature", "0.7"], "greedy only"),
    ],
)
def test_bench_against_mlx_lm_draft_errors(
    pair: PairLoader, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    err = _stderr_of([*argv, "--modes", "baseline", "--prompts", _prompts(tmp_path), "--trials", "1",
                      "--max-tokens", "4", "--quiet"], capsys)  # fmt: skip
    assert message in err and "Traceback" not in err


def test_shared_vocabulary_check_and_defaults() -> None:
    loader = PairLoader()
    target = loader.models["tiny"]
    check_shared_vocabulary(target, loader.models["tiny-draft"])  # same logits, same tokenizer: fine
    with pytest.raises(InvalidRequest, match="160 logits against 192"):
        check_shared_vocabulary(target, loader.models["narrow-draft"])
    with pytest.raises(InvalidRequest, match="tokenizer of 100 tokens"):
        check_shared_vocabulary(target, attrs.evolve(loader.models["tiny-draft"], tokenizer=ByteTokenizer(100)))
    assert draft_model_name("qwen2.5-coder-1.5b", None) == "qwen2.5-coder-0.5b"
    assert draft_model_name("anything", "some/dir") == "some/dir"
    assert num_draft_values(None) == [2, 4, 8] and num_draft_values("8, 2,2") == [2, 8]
    assert reference_kinds("mlx-lm-draft,mlx-lm,mlx-lm-draft") == ["mlx-lm-draft", "mlx-lm"]
    with pytest.raises(ValueError, match=">= 1"):
        MlxLmDraftReference(loader.models["tiny-draft"], 0)
    with pytest.raises(TypeError, match="no mlx-lm module"):
        MlxLmDraftReference(attrs.evolve(loader.models["tiny-draft"], handle=None), 2)
    ref = bootstrap.draft_reference_decoder(loader.models["tiny-draft"], 3)
    assert ref.name == "mlx-lm-draft@3"
    run = ref.generate(target, PROMPT, max_tokens=6, eos_ids=frozenset(), clock=FakeClock())
    assert list(run.token_ids) == ours(target.target, PROMPT, 6)  # type: ignore[arg-type]
