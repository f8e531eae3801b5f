"""pytest-benchmark: time to first token of an agent conversation's second turn on the default model —
cold, warm from the prefix cache, and warm after a short side request between the turns — in one group,
so the table shows the ratios measured in the same run.

    .venv/bin/pytest tests/benchmarks/test_prefix_cache_ttft.py --benchmark-enable -s

Enabled, the conversation is ~6k prompt tokens; disabled (the default run) it is ~600, executed once, and
the warm turns' output is still checked against the cold turn token for token.
"""

from __future__ import annotations

import random
import time

import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.chat_service import ChatService
from mlx_dspark.application.generation import GenerationRequest, GenerationResult, GenerationService
from mlx_dspark.application.modes import build_generator
from mlx_dspark.application.settings import ServerSettings, load_settings
from mlx_dspark.domain.chat import ChatRequest, Conversation, Message, Role, ToolCall, ToolSpec

pytestmark = [pytest.mark.benchmark_suite, pytest.mark.slow]

_VOCABULARY = (
    "agent repository module function parse render cache token prefix branch commit review test failing "
    "passing refactor rename interface adapter domain layer request response stream error retry budget "
    "window context summary title plan step tool result file path line column diff patch apply revert"
)
WORDS = _VOCABULARY.split()
TOOLS = tuple(
    ToolSpec(name=n, description=d, parameters={"type": "object", "properties": {"path": {"type": "string"}}})
    for n, d in (("read_file", "Read a file"), ("write_file", "Write a file"), ("run_tests", "Run the tests"),
                 ("search", "Search the repository"))
)
OUTPUT_TOKENS = 2  # the first token is what is timed; one more checks the warm output


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def conversation(tokens: int, chat: ChatService, gen: GenerationService) -> tuple[str, list[Message], list[Message]]:
    """The system prompt, turn 1 (an ask, a tool call, its result: about `tokens` prompt tokens) and turn 2."""
    rng = random.Random(13)
    call = ToolCall(id="c1", name="read_file", arguments={"path": "src/app.py"})
    code = "\n".join(f"def f{i}(x):\n    return x * {i}  # {prose(rng, 6)}" for i in range(tokens // 60))
    turn1 = [
        Message(role=Role.USER, text="Find why the tests fail and fix it. " + prose(rng, 30)),
        Message(role=Role.ASSISTANT, text="Reading the module.", tool_calls=(call,)),
        Message(role=Role.TOOL, text=code, tool_call_id="c1", tool_name="read_file"),
    ]
    system = prose(rng, 40)
    while len(chat.prompt_ids(gen.model, chat_request(system, turn1))) < tokens:
        system += " " + prose(rng, 40)
    call2 = ToolCall(id="c2", name="run_tests", arguments={"path": "tests"})
    turn2 = [
        *turn1,
        Message(role=Role.ASSISTANT, text="The multiplier is wrong; running the tests.", tool_calls=(call2,)),
        Message(role=Role.TOOL, text=f"3 failed. {prose(rng, 40)}", tool_call_id="c2", tool_name="run_tests"),
    ]
    return system, turn1, turn2


def chat_request(system: str, messages: list[Message]) -> ChatRequest:
    return ChatRequest(conversation=Conversation(system=system, messages=tuple(messages), tools=TOOLS))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    settings = load_settings({"cache_dir": str(tmp_path_factory.mktemp("cache")), "mode": "baseline"}, {})
    services = bootstrap.build(settings)
    try:
        model = services.loader.load_target("default")
    except Exception as exc:
        pytest.skip(f"default model not installed ({exc})")
    gen = build_generator(services, settings, model=model)
    chat = ChatService(services.families, ServerSettings())
    enabled = bool(request.config.getoption("benchmark_enable"))
    system, turn1, turn2 = conversation(6000 if enabled else 400, chat, gen)
    ids1 = chat.prompt_ids(model, chat_request(system, turn1))
    ids2 = chat.prompt_ids(model, chat_request(system, turn2))
    title = [Message(role=Role.USER, text="tests fail")]
    side = chat.prompt_ids(model, chat_request("Write a short title for this conversation.", title))
    generate(gen, ids1, cache=False)  # turn 1, prefilled once; each warm case starts from its state
    return {"gen": gen, "ids1": ids1, "ids2": ids2, "side": side, "turn1": gen.model.target.save_state()}


CPU_SECONDS: dict[int, float] = {}  # id(result) -> process CPU time of its request (robust to a shared CPU)


def generate(gen: GenerationService, ids: list[int], *, cache: bool = True) -> GenerationResult:
    if not cache:
        gen.model.target.reset(0)
    t0 = time.process_time()
    result = gen.generate(GenerationRequest(prompt=ids, max_tokens=OUTPUT_TOKENS, prefix_cache=cache))
    CPU_SECONDS[id(result)] = time.process_time() - t0
    return result


def cold_turn2(setup: dict) -> GenerationResult:
    if "cold" not in setup:
        setup["cold"] = generate(setup["gen"], setup["ids2"], cache=False)
    return setup["cold"]


@pytest.mark.benchmark(group="prefix-cache-ttft")
@pytest.mark.parametrize("case", ["cold", "warm", "warm-after-side-request"])
def test_second_turn_ttft(benchmark, setup: dict, case: str) -> None:  # type: ignore[no-untyped-def]
    gen, ids1, ids2 = setup["gen"], setup["ids1"], setup["ids2"]
    cache = gen.prefix_cache
    assert cache is not None and cache.enabled

    def before() -> None:
        # The server's state right after turn 1: its entry in the cache, its rows in the live target.
        cache.clear()
        gen.model.target.load_state(setup["turn1"], setup["turn1"].length)
        cache.remember(gen.model.target)
        if case == "warm-after-side-request":
            generate(gen, setup["side"])  # the live target now holds the side request

    def turn2() -> GenerationResult:
        return cold_turn2(setup) if case == "cold" else generate(gen, ids2)

    if case != "cold":
        cold_turn2(setup)  # the reference, outside the timed call
    result = benchmark.pedantic(turn2, setup=before, rounds=1, iterations=1)
    cold = cold_turn2(setup)
    assert result.token_ids == cold.token_ids
    if case != "cold":
        assert result.cached_prompt_tokens >= len(ids1) - 8
    ratio = result.time_to_first_token_s / cold.time_to_first_token_s
    cpu, cold_cpu = CPU_SECONDS[id(result)], CPU_SECONDS[id(cold)]
    benchmark.extra_info.update(
        cpu_s=round(cpu, 3),
        cpu_vs_cold=round(cpu / cold_cpu, 4),
        prompt_tokens=len(ids2),
        cached_prompt_tokens=result.cached_prompt_tokens,
        ttft_s=round(result.time_to_first_token_s, 4),
        cold_ttft_s=round(cold.time_to_first_token_s, 4),
        ttft_vs_cold=round(ratio, 4),
    )
    print(
        f"\n{case}: prompt {len(ids2)} tokens, cached {result.cached_prompt_tokens}, "
        f"TTFT {result.time_to_first_token_s:.3f}s, cold {cold.time_to_first_token_s:.3f}s, ratio {ratio:.4f}; "
        f"CPU {cpu:.2f}s vs {cold_cpu:.2f}s, ratio {cpu / cold_cpu:.4f}"
    )
