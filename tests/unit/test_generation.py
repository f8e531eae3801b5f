"""The generation use case: text deltas, stop strings, prefix reuse and results, on fakes via bootstrap."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlx_dspark.application.bootstrap import build
from mlx_dspark.application.generation import GenerationDone, GenerationRequest, GenerationService, TextChunk
from mlx_dspark.application.ports import LoadedModel
from mlx_dspark.application.settings import load_settings
from mlx_dspark.domain.tokens import SamplingParams
from tests.fakes.clock import FakeClock, RecordingTelemetrySink
from tests.fakes.drafts import ScriptedDraftSource
from tests.fakes.oracle import OracleTarget

ALPHABET = "abcdefgh ijklmno"  # 16 symbols, one per oracle token id


class CharTokenizer:
    """One character per token over a 16-symbol alphabet; id 15 ('o') is EOS when `eos` is set."""

    def __init__(self, eos: frozenset[int] = frozenset()) -> None:
        self._eos = eos

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return len(ALPHABET)

    @property
    def chat_template(self) -> str | None:
        return "{% for m in messages %}{{ m.content }}{% endfor %}"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ALPHABET.index(c) for c in text if c in ALPHABET]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(ALPHABET[i] for i in ids)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **_: Any) -> str:
        return "".join(str(m["content"]) for m in messages)


class FakeLoader:
    def __init__(self, model: LoadedModel) -> None:
        self.model = model

    def load_target(self, name: str) -> LoadedModel:
        return self.model

    def load_drafter(self, kind: str, spec: str | None, model: LoadedModel, *, bits: int | None):
        raise AssertionError("not used")

    def available_drafters(self, model: LoadedModel) -> Sequence[str]:
        return []

    def drafter_kind(self, spec: str) -> str | None:
        return None


def make(source=True, eos=frozenset()):
    target = OracleTarget()
    model = LoadedModel(
        name="fake", identity="fake@0", target=target, tokenizer=CharTokenizer(eos), context_window=512, family="fake"
    )
    telemetry = RecordingTelemetrySink()
    services = build(load_settings({}, {}), loader=FakeLoader(model), telemetry=telemetry, clock=FakeClock())
    src = ScriptedDraftSource(target, lambda r, i: i < 2, block=4) if source else None
    gen = GenerationService(model, source=src, mode="scripted" if source else "baseline", clock=services.clock,
                    telemetry=services.telemetry)
    return gen, target, telemetry


def collect(gen, request):
    deltas, result = [], None
    for ev in gen.stream(request):
        if isinstance(ev, TextChunk):
            deltas.append(ev.text)
        elif isinstance(ev, GenerationDone):
            result = ev.result
    return "".join(deltas), result


def test_text_equals_decoded_tokens_and_matches_plain_decoding():
    spec, _, telemetry = make(source=True)
    plain, _, _ = make(source=False)
    req = GenerationRequest(prompt="abc", max_tokens=25)
    text_s, res_s = collect(spec, req)
    text_p, res_p = collect(plain, req)
    assert res_s.token_ids == res_p.token_ids
    assert text_s == text_p == CharTokenizer().decode(res_s.token_ids)
    assert res_s.generated_tokens == 25 and res_s.finish_reason == "length"
    assert res_s.rounds < res_p.rounds
    assert any(type(e).__name__ == "Finished" for _, e in telemetry.events)


def test_stop_string_truncates_text_and_is_reported():
    gen, target, _ = make()
    full = CharTokenizer().decode(target.greedy_continuation(CharTokenizer().encode("abc"), 40))
    stop = full[10:12]
    text, res = collect(gen, GenerationRequest(prompt="abc", max_tokens=40, stop=(stop,)))
    assert text == full[: full.index(stop)]
    assert res.finish_reason == "stop_sequence" and res.stop_sequence == stop


def test_prefix_is_reused_across_turns():
    gen, _target, _ = make()
    _, first = collect(gen, GenerationRequest(prompt="abcdef", max_tokens=8))
    follow_up = "abcdef" + CharTokenizer().decode(first.token_ids) + "gg"
    _, second = collect(gen, GenerationRequest(prompt=follow_up, max_tokens=8))
    assert second.cached_prompt_tokens == 6 + 8 - 1
    fresh, _, _ = make()
    _, expected = collect(fresh, GenerationRequest(prompt=follow_up, max_tokens=8))
    assert second.token_ids == expected.token_ids


def test_eos_ends_the_request_with_stop():
    _probe, target, _ = make()
    cont = target.greedy_continuation(CharTokenizer().encode("abc"), 30)
    gen, _, _ = make(eos=frozenset({cont[5]}))
    _, res = collect(gen, GenerationRequest(prompt="abc", max_tokens=30))
    assert res.finish_reason == "stop"
    assert list(res.token_ids) == cont[: cont.index(cont[5])]


def test_seeded_sampling_is_reproducible_through_the_use_case():
    gen, _, _ = make()
    req = GenerationRequest(prompt="abc", max_tokens=20, sampling=SamplingParams(temperature=1.0, seed=3))
    assert collect(gen, req)[1].token_ids == collect(gen, req)[1].token_ids


def test_a_target_shared_by_two_generators_is_never_reused_stale():
    # GenerationService A caches a conversation; B moves the shared target elsewhere; A must not reuse A's old rows.
    gen_a, _, _ = make()
    gen_b = GenerationService(
        gen_a.model, source=None, mode="baseline", clock=FakeClock(), telemetry=RecordingTelemetrySink()
    )
    _, first = collect(gen_a, GenerationRequest(prompt="abcdef", max_tokens=6))
    collect(gen_b, GenerationRequest(prompt="hijklm", max_tokens=6))
    follow_up = "abcdef" + CharTokenizer().decode(first.token_ids)
    _, again = collect(gen_a, GenerationRequest(prompt=follow_up, max_tokens=6))
    assert again.cached_prompt_tokens == 0
    fresh, _, _ = make()
    assert again.token_ids == collect(fresh, GenerationRequest(prompt=follow_up, max_tokens=6))[1].token_ids


def _finished(telemetry):
    return [e for _, e in telemetry.events if type(e).__name__ == "Finished"]


def test_a_stop_string_finish_reports_its_real_rounds_and_only_the_ids_up_to_the_stop():
    gen, target, telemetry = make()  # drafts of 4, right on the first two slots: several tokens per round
    tok = CharTokenizer()
    full_ids = target.greedy_continuation(tok.encode("abc"), 40)
    full = tok.decode(full_ids)
    stop = full[10:12]
    end = full.index(stop) + len(stop)  # one char per token: the stop completes at token `end`
    text, res = collect(gen, GenerationRequest(prompt="abc", max_tokens=40, stop=(stop,)))
    assert text == full[: full.index(stop)]
    assert res.token_ids == tuple(full_ids[:end]) and res.generated_tokens == end
    rounds = [e for _, e in telemetry.events if type(e).__name__ == "RoundFinished"]
    assert res.rounds == len(rounds) > 0  # the rounds that really ran, not zero
    assert res.drafted == sum(r.drafted for r in rounds) > 0
    assert res.accepted == sum(r.accepted for r in rounds) > 0
    assert res.prefill_s > 0 and res.decode_s > 0 and sum(res.cap_histogram.values()) == res.rounds
    (finished,) = _finished(telemetry)  # one Finished, with the same numbers
    assert finished.reason.value == "stop_sequence" and finished.stop_sequence == stop
    assert finished.usage.generated_tokens == end and finished.usage.rounds == res.rounds


def test_a_stop_string_in_the_first_token_ends_after_prefill():
    gen, target, _ = make()
    tok = CharTokenizer()
    first = tok.decode(target.greedy_continuation(tok.encode("abc"), 1))
    text, res = collect(gen, GenerationRequest(prompt="abc", max_tokens=40, stop=(first,)))
    assert text == "" and res.finish_reason == "stop_sequence" and res.generated_tokens == 1 and res.rounds == 0


def test_text_deltas_carry_only_the_ids_up_to_the_stop():
    gen, target, _ = make()
    tok = CharTokenizer()
    full = tok.decode(target.greedy_continuation(tok.encode("abc"), 40))
    stop = full[10:12]
    ids = [i for ev in gen.stream(GenerationRequest(prompt="abc", max_tokens=40, stop=(stop,)))
           if isinstance(ev, TextChunk) for i in ev.token_ids]
    assert tok.decode(ids) == full[: full.index(stop) + len(stop)]


def test_cached_tokens_never_exceed_the_prompt_even_for_a_repeated_prompt_with_a_stop():
    gen, target, _ = make()
    tok = CharTokenizer()
    full = tok.decode(target.greedy_continuation(tok.encode("abcdef"), 20))
    req = GenerationRequest(prompt="abcdef", max_tokens=20, stop=(full[5:7],))
    collect(gen, req)
    _, again = collect(gen, req)
    assert 0 < again.cached_prompt_tokens <= again.prompt_tokens == 6
