"""Tool calls (`specdec.tools`): each family's call syntax parsed (and malformed calls left as text), the
syntax detected from a chat template, calls streamed apart from content, `required` / named choices forced
valid by a grammar in every family that has one, tools and tool results through a chat template; and the
OpenAI client's whole loop (call, tool result, answer), streamed and not, against `specdec serve`."""

from __future__ import annotations

import json

import pytest

from specdec.engine import DecodeConfig, generate
from specdec.processors import LogitsParams
from specdec.tools import SYNTAXES, ToolCall, ToolChoice, ToolStream, check_tools, detect_syntax, tool_grammar
from specdec.verifiers.stub import StubVerifier

pytest.importorskip("llguidance")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Time now", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
#: a chat template in the Hermes / Qwen call syntax (the syntax is a fact; this template is ours)
HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>You may call:{% for t in tools %} {{ t.function.name }}"
    '{{ t.function.parameters | tojson }}{% endfor %}. Call as <tool_call>{"name", "arguments"}</tool_call>\n'
    "{% endif %}{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}\n{%- elif m.role == 'tool' %}<|tool|><tool_response>{{ m.content }}</tool_response>\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _valid(call: ToolCall) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


# ---- the families' syntaxes --------------------------------------------------------------------------------

ARGS = '{"city": "Oslo", "unit": "c"}'
PARSES = {
    "hermes": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>', "", 1),
        (f'Let me look.<tool_call>{{"name": "get_weather", "arguments": {ARGS}}}</tool_call>\n'
         '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', "Let me look.", 2),
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {ARGS}}}', "", 1),
        (f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}; '
         '{"name": "get_time", "parameters": {"zone": "UTC"}}', "", 2),
    ],
    "mistral": [
        (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}}}]', "", 1),
        (f"[TOOL_CALLS]get_weather[ARGS]{ARGS}[TOOL_CALLS]get_time[ARGS]{{\"zone\": \"UTC\"}}", "", 2),
    ],
    "harmony": [
        (f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>", "", 1),
    ],
    "gemma4": [
        ('<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,unit:<|"|>c<|"|>}<tool_call|>', "", 1),
        ('Let me look.<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>, unit:<|"|>c<|"|>}<tool_call|>'
         '<|tool_call>call:get_time{zone:<|"|>UTC<|"|>}<tool_call|>', "Let me look.", 2),
    ],
}  # fmt: skip
MALFORMED = {
    "hermes": ['<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', "<tool_call>{}"],
    "llama3_json": ['{"name": "get_weather", "parameters": [1]}', "The weather is fine."],
    "mistral": ["[TOOL_CALLS][{]", "[TOOL_CALLS]get_weather[ARGS]{oops"],
    "harmony": ["<|channel|>commentary to=functions.get_weather<|message|>{nope<|call|>"],
    "gemma4": [
        '<|tool_call>call:get_weather{city:<|"|>Oslo}<tool_call|>',
        "<|tool_call>call:get_weather{city Oslo}",
        '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>} and more',
    ],
}


@pytest.mark.parametrize("name", sorted(SYNTAXES))
def test_each_family_parses_its_calls_and_leaves_malformed_ones_as_text(name: str) -> None:
    syntax = SYNTAXES[name]
    for text, head, n in PARSES[name]:
        got = syntax.parse(text)
        assert got is not None, text
        assert got[0] == head and len(got[1]) == n, (text, got)
        assert got[1][0].name == "get_weather" and json.loads(got[1][0].arguments) == json.loads(ARGS)
    for text in MALFORMED[name]:
        assert syntax.parse(text) is None, text
        ts = ToolStream(syntax)
        sent = ts.push(text)
        rest, calls = ts.finish()
        assert calls == [] and sent + rest == text  # the whole reply comes back as text


def test_the_syntax_is_detected_from_the_template() -> None:
    assert detect_syntax(HERMES_TEMPLATE).name == "hermes"
    assert detect_syntax("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert detect_syntax("<|python_tag|>{{ x }}").name == "llama3_json"
    assert detect_syntax("<|start|>assistant to=functions.{{ name }}").name == "harmony"
    assert detect_syntax("{{ '<|tool_call>call:' + name }}").name == "gemma4"
    assert detect_syntax("{{ messages }}") is None and detect_syntax(None) is None


def test_content_streams_and_the_call_is_held_back() -> None:
    ts = ToolStream(SYNTAXES["hermes"])
    call = f'<tool_call>{{"name": "get_weather", "arguments": {ARGS}}}</tool_call>'
    pieces = ["Sure", ", checking", " now. <tool", call[5:20], call[20:]]
    sent = [ts.push(p) for p in pieces]
    assert "".join(sent) == "Sure, checking now. "  # "<tool" was held: it might open a call
    rest, calls = ts.finish()
    assert rest == "" and [c.name for c in calls] == ["get_weather"]
    llama = ToolStream(SYNTAXES["llama3_json"])  # the whole message is the call: nothing streams as content
    assert llama.push('{"name": "get_time", ') == "" and llama.push('"parameters": {"zone": "x"}}') == ""
    assert [c.name for c in llama.finish()[1]] == ["get_time"]
    plain = ToolStream(SYNTAXES["llama3_json"])
    assert plain.push("Hello") == "Hello" and plain.finish() == ("", [])


def test_tools_and_choices_are_checked() -> None:
    assert ToolChoice.parse({"type": "function", "function": {"name": "f"}}) == ToolChoice("named", "f")
    for bad in ["always", {"type": "function"}, 3]:
        with pytest.raises(ValueError, match="'tool_choice' must be"):
            ToolChoice.parse(bad)
    for tools, says in [
        ([], "non-empty list"),
        ([{"type": "function", "function": {"name": "a b"}}], "function.name must be"),
        ([TOOLS[0], TOOLS[0]], "is given twice"),
        ([{"type": "code"}], r"tools\[0\] must be"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": 5}}],
            "parameters must be a JSON schema",
        ),
    ]:
        with pytest.raises(ValueError, match=says):
            check_tools(tools)


# ---- forced calls: every family's grammar yields calls that parse and validate --------------------------


@pytest.mark.parametrize("name", sorted(SYNTAXES))
def test_required_and_named_calls_are_valid_in_every_family(name: str) -> None:
    """The stub (a random model) under each grammar: the reply parses in the family's syntax, each call's
    arguments validate; a named choice calls that function alone; without parallel calls, one call; and
    speculation (a random drafter) gives the same reply."""
    from drafters import RandomDrafter

    v = StubVerifier()
    prompt = v.tokenizer.encode("Call a tool:")
    syntax = SYNTAXES[name]
    for choice, parallel in [(ToolChoice("required"), True), (ToolChoice("named", "get_time"), True),
                             (ToolChoice("required"), False)]:  # fmt: skip
        params = LogitsParams(grammar=tool_grammar(syntax, TOOLS, choice, parallel))
        cfg = DecodeConfig(max_new_tokens=800, block_size=1, logits=params)  # 8 calls at most
        run = generate(v, prompt, cfg=cfg)
        assert run.finish_reason == "stop", run.text
        parsed = syntax.parse(run.text)
        assert parsed is not None and parsed[1], run.text
        for call in parsed[1]:
            _valid(call)
            assert choice.name in (None, call.name)
        if not parallel or syntax.form.single:
            assert len(parsed[1]) == 1
        spec = generate(v, prompt, drafter=RandomDrafter(vocab=v.vocab_size, block_size=6),
                        cfg=DecodeConfig(max_new_tokens=800, block_size=6, logits=params))  # fmt: skip
        assert spec.output_tokens == run.output_tokens
    with pytest.raises(ValueError, match="not among the tools"):
        tool_grammar(syntax, TOOLS, ToolChoice("named", "nope"), True)


# ---- through a chat template ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    pytest.importorskip("transformers")
    from tinymodels import tiny_llama, tiny_tokenizer

    path = tmp_path_factory.mktemp("tools") / "llama"
    return tiny_tokenizer(tiny_llama(path), chat_template=HERMES_TEMPLATE, bos=1, eos=2)


@pytest.mark.hf
def test_tools_and_results_go_through_the_template(tool_model) -> None:
    from specdec.chat import encode_prompt
    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(tool_model)
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    text = v.tokenizer.decode(encode_prompt(v, msgs, tools=TOOLS))
    assert "get_weather" in text and "get_time" in text and "maxLength" in text
    turn = [*msgs, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"}]  # fmt: skip
    text = v.tokenizer.decode(encode_prompt(v, turn, tools=TOOLS))
    assert f'"arguments": {ARGS}' in text and "<tool_response>12 degrees</tool_response>" in text
    stub = StubVerifier()  # no chat template: tools are refused, not dropped
    with pytest.raises(ValueError, match="chat template has no tool syntax"):
        encode_prompt(stub, msgs, tools=TOOLS)
    with pytest.raises(ValueError, match="tools are given to a model with chat messages"):
        encode_prompt(v, "plain text", tools=TOOLS)


@pytest.mark.hf
def test_the_openai_client_tools_loop(tool_model) -> None:
    """`required`: a call whose arguments validate, finish "tool_calls", streamed as one delta per call;
    named: that function; the tool's result back (`role: tool`) and an answer in text; `auto` on a model
    that writes no call: plain text. A model without tool syntax: a 400 naming 'tools'."""
    pytest.importorskip("starlette")
    openai = pytest.importorskip("openai")
    import httpx
    from test_server import Served

    from specdec.drafting.lookup.prompt import PromptLookupDrafter
    from specdec.serve import build_app
    from specdec.stream import StreamingEngine
    from specdec.verifiers.hf import HFVerifier

    served = Served(build_app(StreamingEngine(HFVerifier(tool_model), PromptLookupDrafter(block_size=6))))
    try:
        client = served.client()
        msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
        r = client.chat.completions.create(model=served_model(served), messages=msgs, tools=TOOLS,
                                           tool_choice="required", max_tokens=120)  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        calls = [ToolCall(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        for c in calls:
            _valid(c)
        kw = {"model": served_model(served), "messages": msgs, "tools": TOOLS, "max_tokens": 120}
        chunks = list(client.chat.completions.create(**kw, tool_choice="required", stream=True))
        streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [(t.function.name, t.function.arguments) for t in streamed] == [
            (c.name, c.arguments) for c in calls
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        named = {"type": "function", "function": {"name": "get_time"}}
        r2 = client.chat.completions.create(model=served_model(served), messages=msgs, tools=TOOLS,
                                            tool_choice=named, max_tokens=120)  # fmt: skip
        assert {c.function.name for c in r2.choices[0].message.tool_calls} == {"get_time"}
        back = [*msgs, choice.message.model_dump(exclude_none=True),
                *[{"role": "tool", "tool_call_id": c.id, "content": "12 degrees, clear"}
                  for c in choice.message.tool_calls]]  # fmt: skip
        final = client.chat.completions.create(model=served_model(served), messages=back, tools=TOOLS,
                                               max_tokens=16)  # fmt: skip
        assert final.choices[0].message.content and final.choices[0].finish_reason in ("stop", "length")
        url = served.url + "/v1/chat/completions"
        for bad, param in [({"tool_choice": "required"}, "tool_choice"),
                           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
                            "tool_choice"),
                           ({"tools": [{"type": "function"}]}, "tools")]:  # fmt: skip
            res = httpx.post(url, json={"messages": msgs, "max_tokens": 4, **bad})
            assert res.status_code == 400 and res.json()["error"]["param"] == param, res.text
    finally:
        served.stop()
    stub = Served(build_app(StreamingEngine(StubVerifier())))
    try:
        res = httpx.post(stub.url + "/v1/chat/completions", json={"messages": msgs, "tools": TOOLS})
        assert res.status_code == 400 and res.json()["error"]["param"] == "tools", res.text
        assert "no tool syntax" in res.json()["error"]["message"]
        with pytest.raises(openai.BadRequestError):
            stub.client().chat.completions.create(model=served_model(stub), messages=msgs, tools=TOOLS)
    finally:
        stub.stop()


def served_model(served) -> str:
    import httpx

    return httpx.get(served.url + "/v1/models").json()["data"][0]["id"]


# ---- Gemma 4: arguments in its own value syntax, from the schema ------------------------------------------


def _obj(required: list[str], **props: dict) -> dict:
    return {"type": "object", "properties": props, "required": required}


GEMMA_SCHEMAS = [
    _obj(["n", "x", "ok", "none"], n={"type": "integer"}, x={"type": "number"}, ok={"type": "boolean"},
         none={"type": "null"}),
    _obj(["b"], a={"type": "string", "maxLength": 4}, b={"type": "string", "minLength": 1, "maxLength": 3}),
    _obj(["tags"], tags={"type": "array", "items": {"enum": ["x", "y", 3]}, "minItems": 1, "maxItems": 3}),
    _obj(["p"], p=_obj(["q"], q={"type": ["integer", "null"]})),
    _obj(["v", "c"], v={"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]},
         c={"const": "k"}),
    {**_obj([], o1={"type": "integer"}, o2={"type": "boolean"}), "additionalProperties": False},
]  # fmt: skip


def _fn(schema: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def _accepts(source: str, text: str, v=None) -> bool:
    """Whether the Lark grammar `source` accepts `text` whole in `v`'s tokens (default: the stub's)."""
    import llguidance

    from specdec.grammar import grammar_tokenizer

    v = v or StubVerifier()
    tok = grammar_tokenizer(v.tokenizer, v.vocab_size, sorted(v.eos_token_ids))
    m = llguidance.LLMatcher(tok, llguidance.grammar_from("lark", source), log_level=1)
    stub = isinstance(v, StubVerifier)
    ids = v.tokenizer.encode(text)[1:] if stub else v.tokenizer.encode(text, add_special_tokens=False)
    return m.consume_tokens(ids) and m.is_accepting()


def test_forced_gemma4_calls_keep_each_schema_in_gemmas_syntax() -> None:
    """Every schema's forced call, written by a random model, parses in Gemma's syntax and validates; the
    grammar accepts free strings with '<' in them and any value where the schema allows any, and refuses a
    string closed early; keywords it cannot keep are refused by name."""
    jsonschema = pytest.importorskip("jsonschema")
    v = StubVerifier()
    prompt = v.tokenizer.encode("Call:")
    gemma = SYNTAXES["gemma4"]
    for schema in GEMMA_SCHEMAS:
        params = LogitsParams(grammar=tool_grammar(gemma, [_fn(schema)], ToolChoice("required"), False))
        run = generate(v, prompt, cfg=DecodeConfig(max_new_tokens=400, logits=params))
        parsed = gemma.parse(run.text)
        assert run.finish_reason == "stop" and parsed is not None, (schema, run.text)
        jsonschema.validate(json.loads(parsed[1][0].arguments), schema)
    free = {"type": "object", "properties": {"s": {"type": "string"}, "any": {}}, "required": ["s", "any"]}
    source = tool_grammar(gemma, [_fn(free)], ToolChoice("required"), False).source
    call = '<|tool_call>call:f{{s:<|"|>{}<|"|>,any:{}}}<tool_call|>'
    assert _accepts(source, call.format("a<b <| x", '{k:[1,<|"|>t<|"|>,{}],m:null}'))
    assert not _accepts(source, call.format('a<|"|>b', "1"))
    assert gemma.parse(call.format("a<b", '{k:[1,<|"|>t<|"|>]}'))[1][0].arguments == (
        '{"s": "a<b", "any": {"k": [1, "t"]}}'
    )
    for schema, says in [({"type": "string", "pattern": "a+"}, "'pattern' at parameters"),
                         ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}},
                          "'minimum' at parameters.n"),
                         ({"oneOf": [{"type": "integer"}]}, "'oneOf'")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"cannot keep the schema keyword {says}"):
            tool_grammar(gemma, [_fn(schema)], ToolChoice("required"), False)


GEMMA_TEMPLATE = (  # Gemma 4's call syntax (a fact); the template is ours
    "{%- for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{%- endfor %}"
    "{%- if tools %}{% for t in tools %}<|tool>{{ t.function.name }}<tool|>{% endfor %}"
    "Call as <|tool_call>call:NAME{key:value}<tool_call|>{% endif %}"
    "{%- if add_generation_prompt %}<|turn>model\n{% endif %}"
)


@pytest.mark.hf
def test_forced_calls_write_the_syntax_in_its_special_tokens(tmp_path) -> None:
    """Where the tokenizer has the call syntax's marks as special tokens (Gemma 4's `<|tool_call>`,
    `<|"|>`...), a forced call writes those tokens, not their text spelled in bytes; the reply, decoded
    with them kept, parses and validates."""
    pytest.importorskip("transformers")
    from tinymodels import tiny_llama, tiny_tokenizer

    from specdec.tools import special_ids
    from specdec.verifiers.hf import HFVerifier

    marks = ["<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>"]
    v = HFVerifier(tiny_tokenizer(tiny_llama(tmp_path / "m"), chat_template=GEMMA_TEMPLATE, more=marks))
    special = special_ids(v.tokenizer)
    assert sorted(special) == sorted(marks)
    syntax = detect_syntax(GEMMA_TEMPLATE)
    assert syntax is SYNTAXES["gemma4"]
    grammar = tool_grammar(syntax, TOOLS, ToolChoice("required"), False, special=special)
    cfg = DecodeConfig(max_new_tokens=200, logits=LogitsParams(grammar=grammar))
    run = generate(v, v.tokenizer.encode("Weather?"), cfg=cfg)
    assert run.finish_reason == "stop"
    assert {special["<|tool_call>"], special['<|"|>']} <= set(run.output_tokens)
    assert run.output_tokens[-1] in v.eos_token_ids
    calls = syntax.parse(v.tokenizer.decode(run.output_tokens[:-1], skip_special_tokens=False))[1]
    assert calls
    for c in calls:
        _valid(c)


@pytest.mark.hf
def test_the_python_api_tools_loop(tool_model) -> None:
    """Without HTTP: a ChatSession with tools; a forced call comes back in `result.message["tool_calls"]`
    (valid, and no call text in the streamed content), goes into the conversation with its result, and the
    model answers in text; `response_format` on `StreamingEngine.stream`; contradictory options refused."""
    from specdec.drafting.lookup.prompt import PromptLookupDrafter
    from specdec.stream import ChatSession, StreamingEngine
    from specdec.verifiers.hf import HFVerifier

    engine = StreamingEngine(HFVerifier(tool_model), PromptLookupDrafter(block_size=6))
    chat = ChatSession(engine, tools=TOOLS)
    s = chat.send("What is the weather in Oslo?", tool_choice="required", max_tokens=120)
    events = list(s)
    calls = s.result.message["tool_calls"]
    assert s.result.finish_reason == "stop" and calls, s.result.text
    for c in calls:
        _valid(ToolCall(c["function"]["name"], c["function"]["arguments"]))
    assert "".join(e.content for e in events) == "" and s.result.message["content"] is None
    assert chat.messages[-1]["tool_calls"] == calls
    for c in calls:
        chat.tool_result(c["id"], "12 degrees, clear")
    final = chat.send(None, max_tokens=12)
    text = "".join(e.content for e in final)
    assert (
        text == final.result.message["content"] == final.result.text and "tool_calls" not in chat.messages[-1]
    )
    assert "<tool_response>12 degrees, clear</tool_response>" in engine.verifier.tokenizer.decode(
        chat.prompt_ids()
    )
    msgs = [{"role": "user", "content": "JSON please"}]
    schema = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    r = engine.complete(msgs, response_format=schema, max_tokens=200)
    assert r.finish_reason == "stop", r.text
    _valid(ToolCall("get_weather", r.text))
    for kw, says in [({"tool_choice": "required"}, "without tools"),
                     ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                      "not both"),
                     ({"tools": [{"type": "x"}]}, r"tools\[0\] must be")]:  # fmt: skip
        with pytest.raises(ValueError, match=says):
            engine.stream(msgs, **kw)


@pytest.mark.hf
def test_generate_takes_a_template_and_tools(tmp_path, capsys) -> None:
    """`specdec generate --messages ... --chat-template FILE --tools JSON --tool-choice NAME`: the template
    in place of the model's (which has none), the forced call printed as one JSON line that validates;
    --tools without --messages, and a --tools that is not a tools list, refused in one line."""
    pytest.importorskip("transformers")
    from tinymodels import tiny_llama, tiny_tokenizer

    from specdec.cli import main

    model = tiny_tokenizer(tiny_llama(tmp_path / "m"), bos=1, eos=2)  # no chat template of its own
    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    msgs = json.dumps([{"role": "user", "content": "Time in Oslo?"}])
    base = ["generate", "--verifier", "hf", "--model", str(model), "--drafter", "prompt-lookup",
            "--max-new-tokens", "120"]  # fmt: skip
    assert main([*base, "--messages", msgs, "--chat-template", str(template), "--tools", json.dumps(TOOLS),
                 "--tool-choice", "get_time"]) == 0  # fmt: skip
    calls = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    _valid(ToolCall("get_time", calls[0]["function"]["arguments"]))
    for extra, says in [(["--prompt", "hi", "--tools", json.dumps(TOOLS)], "go with --messages"),
                        (["--messages", msgs, "--tools", "[1]"], "--tools: tools[0] must be"),
                        (["--messages", msgs, "--tool-choice", "required"], "goes with --tools"),
                        (["--messages", msgs, "--tools", str(tmp_path / "no")], "--tools: cannot read"),
                        (["--messages", msgs, "--tools", "[1"], "--tools is not valid JSON")]:  # fmt: skip
        assert main([*base, *extra]) == 2
        assert says in capsys.readouterr().err


def test_a_thinking_model_may_reason_before_a_forced_call(tmp_path) -> None:
    """Under a forced tool choice a thinking model may reason first: where the prompt opened the reasoning
    the reply must close it before its calls, else reasoning is optional; the tag is text (`<think>`, a
    lazy lexeme ending at its first occurrence) or a special token (Gemma 4's channel). The split then gives
    the reasoning apart and the calls parsed, not swallowed into the reasoning."""
    from specdec.reasoning import REASONING_SYNTAXES
    from specdec.reply import ReplyFormat

    think, hermes = REASONING_SYNTAXES["think"], SYNTAXES["hermes"]
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'

    def grammar(opened: bool, syntax=hermes, reasoning=think, special=None) -> str:
        g = tool_grammar(syntax, TOOLS, ToolChoice("required"), False, reasoning=reasoning, opened=opened,
                         special=special)  # fmt: skip
        return g.source

    assert _accepts(grammar(True), f"Check: a < b, </thin.</think>\n\n{call}")
    assert not _accepts(grammar(True), call)  # the opened reasoning must close first
    assert not _accepts(grammar(True), f"x</think>y</think>{call}")  # it ends at the first end tag
    assert _accepts(grammar(False), call) and _accepts(grammar(False), f"<think>hm</think>\n{call}")
    v = StubVerifier()
    fmt = ReplyFormat(reasoning=think, calls=hermes, marks={}, raw_text=v.tokenizer.decode, clean_text=str,
                      stop_ids=v.eos_token_ids)  # fmt: skip
    split = fmt.split(tools=True, opened=True)
    reply = f"Check the time.</think>\n\n{call}"
    out = [split.push(reply[:9], []), split.push(reply[9:], [])]
    thought, rest, calls = split.finish()
    assert (
        "".join(r for r, _ in out) + thought == "Check the time." and "".join(c for _, c in out) + rest == ""
    )
    assert [c.name for c in calls] == ["get_time"]
    pytest.importorskip("transformers")  # Gemma 4's channel in special tokens
    from tinymodels import tiny_llama, tiny_tokenizer

    from specdec.tools import special_ids
    from specdec.verifiers.hf import HFVerifier

    marks = ["<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>"]
    hf = HFVerifier(tiny_tokenizer(tiny_llama(tmp_path / "m"), more=marks))
    g = grammar(False, SYNTAXES["gemma4"], REASONING_SYNTAXES["gemma4"], special_ids(hf.tokenizer))
    gcall = '<|tool_call>call:get_time{zone:<|"|>UTC<|"|>}<tool_call|>'
    assert _accepts(g, f"<|channel>thought\nHm, a <channel| b.<channel|>{gcall}", hf)
    assert _accepts(g, gcall, hf) and not _accepts(g, f"<|channel>thought\nHm{gcall}", hf)


def test_chat_options_on_a_text_prompt_are_refused_not_ignored() -> None:
    """Tools, tool choices and chat template arguments reach a chat template only: a text completion (or a
    text / token-id prompt in the API) that sends them is refused in one line naming the field."""
    pytest.importorskip("starlette")
    from specdec.chat import encode_prompt
    from specdec.sampling import SamplingParams
    from specdec.serve.protocol import CHAT_ONLY, RequestError, parse_request

    body = {"prompt": "Hi", "max_tokens": 4}
    values = {
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "chat_template_kwargs": {"enable_thinking": False},
        "reasoning_effort": "low",
        "thinking_budget": 8,
    }
    for name in CHAT_ONLY:
        with pytest.raises(RequestError, match=f"'{name}' goes with chat messages") as e:
            parse_request({**body, name: values[name]}, chat=False, model="m", defaults=SamplingParams())
        assert e.value.param == name
    parse_request(body, chat=False, model="m", defaults=SamplingParams())  # without them: fine
    v = StubVerifier()
    with pytest.raises(ValueError, match="chat template arguments go with chat messages"):
        encode_prompt(v, "Hi", template_kwargs={"enable_thinking": False})
