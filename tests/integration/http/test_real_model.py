"""End to end on the real default model: one streamed request per dialect through the official SDKs."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from mlx_dspark.application import bootstrap
from mlx_dspark.application.settings import load_settings
from mlx_dspark.entrypoints.http.app import create_app
from tests.integration.http.conftest import _serve

pytestmark = pytest.mark.slow
USER = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    bootstrap.runtime().prepare()
    settings = load_settings({"model": "default", "mode": "baseline"}, environ={})
    app = create_app(bootstrap.build_server(bootstrap.build(settings), settings))
    for base, _ in _serve(app):
        yield base


def _model(base_url: str) -> str:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x").models.list().data[0].id


def test_chat_completions(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=_model(base_url),
            messages=USER,  # type: ignore[arg-type]
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and reasons in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 8


def test_responses(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    with client.responses.stream(model=_model(base_url), input="Say hi.", max_output_tokens=8) as stream:
        final = stream.get_final_response()
    assert final.output_text and final.usage is not None and final.usage.output_tokens <= 8


def test_anthropic_messages(base_url: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    with client.messages.stream(model=_model(base_url), max_tokens=8, messages=USER) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert final.content and final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens <= 8
