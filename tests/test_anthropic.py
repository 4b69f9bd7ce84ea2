"""Anthropic's Messages API (`/v1/messages`) through the real `anthropic` client: text replies equal the
OpenAI endpoint's for the same conversation, streamed and not; stop reasons; tools with `input_schema`,
`tool_choice` any / tool forced valid, `tool_use` blocks, `tool_result` back; reasoning as a thinking
block; errors in Anthropic's shape."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

from test_server import Served  # noqa: E402
from test_tools import HERMES_TEMPLATE, SCHEMAS, WEATHER  # noqa: E402

from specdec.drafting.lookup.prompt import PromptLookupDrafter  # noqa: E402
from specdec.serve import build_app  # noqa: E402
from specdec.stream import StreamingEngine  # noqa: E402
from specdec.verifiers.stub import StubVerifier  # noqa: E402

ASK = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def stub():
    served = Served(build_app(StreamingEngine(StubVerifier(), PromptLookupDrafter(block_size=8))))
    yield served
    served.stop()


def _client(served):
    return anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0)


def _model(served) -> str:
    return httpx.get(served.url + "/v1/models").json()["data"][0]["id"]


def test_a_text_reply_equals_the_openai_endpoints(stub) -> None:
    client = _client(stub)
    system = "You are terse."
    m = client.messages.create(model=_model(stub), max_tokens=20, system=system, messages=ASK)
    oa = httpx.post(
        stub.url + "/v1/chat/completions",
        json={"messages": [{"role": "system", "content": system}, *ASK], "max_tokens": 20},
    ).json()
    assert m.type == "message" and m.role == "assistant" and [b.type for b in m.content] == ["text"]
    assert m.content[0].text == oa["choices"][0]["message"]["content"]
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[oa["choices"][0]["finish_reason"]]
    assert m.usage.output_tokens == oa["usage"]["completion_tokens"]
    with client.messages.stream(model=_model(stub), max_tokens=20, system=system, messages=ASK) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == m.content[0].text and final.stop_reason == m.stop_reason
    stop = m.content[0].text[3:5]
    if stop.strip():
        cut = client.messages.create(
            model=_model(stub), max_tokens=20, system=system, messages=ASK, stop_sequences=[stop]
        )
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop


def test_errors_come_in_anthropics_shape(stub) -> None:
    client = _client(stub)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=_model(stub),
            max_tokens=10,
            messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}
            ],
        )
    assert "image" in str(e.value)
    r = httpx.post(stub.url + "/v1/messages", json={"messages": ASK})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert (
        "max_tokens" in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
    )
    with pytest.raises(anthropic.BadRequestError, match="no tool syntax"):  # the stub has no chat template
        client.messages.create(
            model=_model(stub),
            max_tokens=10,
            messages=ASK,
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
        )


@pytest.mark.hf
def test_the_tools_loop(tmp_path) -> None:
    """`tool_choice` any: a `tool_use` block whose input validates, stop reason `tool_use`, streamed as an
    input_json_delta; a named tool; the `tool_result` back and a text answer."""
    pytest.importorskip("transformers")
    jsonschema = pytest.importorskip("jsonschema")
    from tinymodels import tiny_llama, tiny_tokenizer

    from specdec.verifiers.hf import HFVerifier

    model = tiny_tokenizer(tiny_llama(tmp_path / "llama"), chat_template=HERMES_TEMPLATE, bos=1, eos=2)
    served = Served(build_app(StreamingEngine(HFVerifier(model), PromptLookupDrafter(block_size=6))))
    try:
        client, name = _client(served), _model(served)
        tools = [
            {"name": "get_weather", "description": "Weather now", "input_schema": WEATHER},
            {"name": "get_time", "input_schema": SCHEMAS["get_time"]},
        ]
        ask = [{"role": "user", "content": "Weather in Oslo?"}]
        m = client.messages.create(
            model=name, max_tokens=120, messages=ask, tools=tools, tool_choice={"type": "any"}
        )
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses
        for u in uses:
            jsonschema.validate(u.input, SCHEMAS[u.name])
        with client.messages.stream(
            model=name, max_tokens=120, messages=ask, tools=tools, tool_choice={"type": "any"}
        ) as s:
            final = s.get_final_message()
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
            (u.name, u.input) for u in uses
        ]
        one = client.messages.create(
            model=name,
            max_tokens=120,
            messages=ask,
            tools=tools,
            tool_choice={"type": "tool", "name": "get_time"},
        )
        assert {b.name for b in one.content if b.type == "tool_use"} == {"get_time"}
        back = [
            *ask,
            {"role": "assistant", "content": [u.model_dump() for u in uses]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": u.id, "content": json.dumps({"celsius": 12})}
                    for u in uses
                ],
            },
        ]
        answer = client.messages.create(model=name, max_tokens=12, messages=back, tools=tools)
        assert answer.content and answer.content[0].type == "text" and answer.content[0].text
    finally:
        served.stop()
