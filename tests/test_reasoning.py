"""A thinking model's reasoning apart from its answer (`specdec.reasoning`): the split of streamed text
(tags across deltas, a prompt that opened the reasoning, a reply without any), and the server's
`reasoning_content`, streamed and not, with `chat_template_kwargs` reaching the template."""

from __future__ import annotations

import random

import pytest

from specdec.reasoning import REASONING_SYNTAXES, HarmonyStream, ReasoningStream, detect_reasoning

THINK = REASONING_SYNTAXES["think"]
#: a thinking model's template (the `<think>` convention is a fact; this template is ours): the generation
#: prompt opens the reasoning unless enable_thinking is false
TEMPLATE = (
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is not defined or enable_thinking %}"
    "<think>\n{% endif %}{% endif %}{# a reply closes it with </think> #}"
)


def _split(pieces, opened=False, stream=None):
    rs = stream or ReasoningStream(THINK, opened=opened)
    out = [rs.push(p) for p in pieces] + [rs.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


def _cuts(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, 12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_the_split_whatever_the_deltas() -> None:
    rng = random.Random(0)
    gemma = REASONING_SYNTAXES["gemma4"]
    harmony = "<|channel|>analysis<|message|>Let me see.<|end|><|start|>assistant<|channel|>final<|message|>"
    preamble = (
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>analysis<|message|>"
    )
    call = "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"
    for text, stream, want in [
        ("<think>\nLet me see: 2 + 2.</think>\n\nIt is 4.", lambda: None,
         ("\nLet me see: 2 + 2.", "It is 4.")),
        ("<|channel>thought\nLet me see.<channel|>It is 4.", lambda: ReasoningStream(gemma),
         ("Let me see.", "It is 4.")),
        (harmony + "It is 4.", HarmonyStream, ("Let me see.", "It is 4.")),
        (preamble + "Hm.<|end|>" + call, HarmonyStream, ("Hm.", "Checking.")),
    ]:  # fmt: skip
        for _ in range(50):  # cut anywhere, tags included
            pieces = _cuts(text, rng)
            assert _split(pieces, stream=stream()) == want, pieces
    assert _split(["Let me ", "think.</th", "ink>Done."], opened=True) == ("Let me think.", "Done.")
    assert _split(["  <th", "ink>a", "</think>b"]) == ("a", "b")
    assert _split(["No reasoning here."]) == ("", "No reasoning here.")
    assert _split(["<thi", "s is html>"]) == ("", "<this is html>")  # not the tag after all
    assert _split(["still thinking </thi"], opened=True) == ("still thinking </thi", "")  # cut short
    assert _split(["It is 4."], stream=HarmonyStream()) == ("", "It is 4.")  # no channels
    assert _split(["<|channel|>analysis<|message|>cut sh"], stream=HarmonyStream()) == ("cut sh", "")


def test_the_syntax_is_detected() -> None:
    assert detect_reasoning(TEMPLATE) is THINK
    assert detect_reasoning(GEMMA_TEMPLATE).name == "gemma4"
    assert (
        detect_reasoning("<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}").name == "harmony"
    )
    assert detect_reasoning("{{ messages }}") is None and detect_reasoning(None) is None


def _six_letters_then_three_digits(url: str, body: dict) -> None:
    """The reply to `body` (a grammar: six letters of reasoning, then three digits) split so, streamed and
    not."""
    import httpx

    msg = httpx.post(url, json=body).json()["choices"][0]["message"]
    assert len(msg["reasoning_content"]) == 6 and msg["reasoning_content"].isalpha(), msg
    assert len(msg["content"]) == 3 and msg["content"].isdigit(), msg
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(httpx.Response(200, content=line[6:]).json())
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]


@pytest.mark.hf
def test_the_server_keeps_reasoning_apart(tmp_path) -> None:
    """The template opens the reasoning: what the model writes before `</think>` is `reasoning_content`, the
    rest `content` (a regex makes a random model write both), streamed and not; `enable_thinking: false`
    through `chat_template_kwargs` leaves the reply all content."""
    pytest.importorskip("starlette")
    pytest.importorskip("transformers")
    import httpx
    from test_server import Served
    from tinymodels import tiny_llama, tiny_tokenizer

    from specdec.drafting.lookup.prompt import PromptLookupDrafter
    from specdec.serve import build_app
    from specdec.stream import StreamingEngine
    from specdec.verifiers.hf import HFVerifier

    model = tiny_tokenizer(tiny_llama(tmp_path / "llama"), chat_template=TEMPLATE, bos=1, eos=2)
    served = Served(build_app(StreamingEngine(HFVerifier(model), PromptLookupDrafter(block_size=6))))
    try:
        url = served.url + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 40,
                "structured_outputs": {"regex": "[a-z]{6}</think>\n[0-9]{3}"}}  # fmt: skip
        _six_letters_then_three_digits(url, body)
        off = {**body, "chat_template_kwargs": {"enable_thinking": False},
               "structured_outputs": {"regex": "[0-9]{4}"}}  # fmt: skip
        msg = httpx.post(url, json=off).json()["choices"][0]["message"]
        assert msg["reasoning_content"] is None and len(msg["content"]) == 4, msg
        for bad in [{"chat_template_kwargs": [1]}, {"chat_template_kwargs": {"tools": []}},
                    {"reasoning_effort": "max"}]:  # fmt: skip
            r = httpx.post(url, json={**body, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] in bad, r.text
    finally:
        served.stop()


GEMMA_MARKS = ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>']
#: Gemma 4's reasoning and call syntax (facts); the template is ours
GEMMA_TEMPLATE = (
    "{%- for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{%- endfor %}"
    "{%- if tools %}Call as <|tool_call>call:NAME{key:value}<tool_call|>{% endif %}"
    "{%- if add_generation_prompt %}<|turn>model\n{% endif %}{# thinking: <|channel>thought ...<channel|> #}"
)


@pytest.mark.hf
def test_the_server_splits_reasoning_written_in_special_tokens(tmp_path) -> None:
    """Gemma 4's `<|channel>thought\n...<channel|>` in special tokens (plain decoding drops them, so the split
    must read the text that keeps them): reasoning and content apart, streamed and not, no mark left in
    either."""
    pytest.importorskip("starlette")
    pytest.importorskip("transformers")
    from test_server import Served
    from tinymodels import tiny_llama, tiny_tokenizer

    from specdec.drafting.lookup.prompt import PromptLookupDrafter
    from specdec.serve import build_app
    from specdec.stream import StreamingEngine
    from specdec.verifiers.hf import HFVerifier

    path = tiny_tokenizer(
        tiny_llama(tmp_path / "m"), chat_template=GEMMA_TEMPLATE, bos=1, eos=2, more=GEMMA_MARKS
    )
    v = HFVerifier(path)
    ids = {m: v.tokenizer.convert_tokens_to_ids(m) for m in GEMMA_MARKS}
    served = Served(build_app(StreamingEngine(v, PromptLookupDrafter(block_size=6))))
    try:
        url = served.url + "/v1/chat/completions"
        lark = (
            f'start: <[{ids["<|channel>"]}]> "thought\\n" /[a-z]{{6}}/ <[{ids["<channel|>"]}]> /[0-9]{{3}}/'
        )
        body = {"messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 40,
                "structured_outputs": {"grammar": lark}}  # fmt: skip
        _six_letters_then_three_digits(url, body)
    finally:
        served.stop()


@pytest.mark.hf
def test_reasoning_then_a_call_in_special_tokens_whatever_the_steps(tmp_path) -> None:
    """The server's split of a Gemma 4 reply that thinks, then calls a tool, as its tokens come in steps of
    any size: the reasoning apart, no content (no mark, no call text leaking), the call parsed."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from tinymodels import tiny_tokenizer
    from transformers import AutoTokenizer

    from specdec.reply import ReplyFormat

    tok = AutoTokenizer.from_pretrained(
        tiny_tokenizer(tmp_path, chat_template=GEMMA_TEMPLATE, more=GEMMA_MARKS)
    )
    fmt = ReplyFormat.of(SimpleNamespace(tokenizer=tok, eos_token_ids=[1]))  # read from the template
    assert (fmt.reasoning.name, fmt.calls.name) == ("gemma4", "gemma4")
    reply = "<|channel>thought\nCheck the time.<channel|>"
    reply += '<|tool_call>call:get_time{zone:<|"|>UTC<|"|>}<tool_call|>'
    ids = [*tok.encode(reply, add_special_tokens=False), 1]
    assert sum(i >= 261 for i in ids) == 6  # the marks are single tokens
    rng = random.Random(0)
    for _ in range(30):
        split = fmt.split(tools=True)
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randrange(1, 10)))
        out = [split.push("", ids[a:b]) for a, b in zip([0, *cuts], [*cuts, len(ids)])]
        thought, rest, calls = split.finish()
        assert "".join(r for r, _ in out) + thought == "Check the time."
        assert "".join(c for _, c in out) + rest == ""
        assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "UTC"}')]


# ---- a thinking budget ----------------------------------------------------------------------------------


def test_the_budget_forces_the_end_tag_token_by_token() -> None:
    from specdec.reasoning import ThinkingBudget

    end, start = (7, 8, 9), (5,)
    b = ThinkingBudget(3, end, start, opened=True)
    assert b.forced([1, 2]) is None  # within the budget
    assert [b.forced(h) for h in ([1, 2, 3], [1, 2, 3, 7], [1, 2, 3, 7, 8])] == [7, 8, 9]
    assert b.forced([1, 2, 3, 7, 8, 9]) is None and b.forced([7, 8, 9, 1, 2, 3, 4]) is None  # ended
    closed = ThinkingBudget(2, end, start)
    assert closed.forced([1, 2, 3]) is None  # no reasoning opened: nothing to cut
    assert closed.forced([5, 1, 2]) == 7 and closed.forced([5, 1]) is None  # after the start tag
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="thinking budget"):
            ThinkingBudget(bad, end)


def test_a_budget_is_exact_under_speculation() -> None:
    """The stub, its reply inside the reasoning: the end tag comes right after the budget, and speculation
    (drafters that accept all, none, a part) commits the same tokens; without the budget the text differs."""
    from drafters import ScriptedDrafter

    from specdec.engine import DecodeConfig, generate
    from specdec.processors import LogitsParams
    from specdec.reasoning import ThinkingBudget
    from specdec.verifiers.stub import StubVerifier

    v = StubVerifier()
    prompt = v.tokenizer.encode("Question? <think>")
    end = tuple(b"</think>")
    params = LogitsParams(thinking=ThinkingBudget(6, end, tuple(b"<think>"), opened=True))

    def run(d, p):
        cfg = DecodeConfig(max_new_tokens=30, block_size=6 if d else 1, stop_token_ids=frozenset(), logits=p)
        return generate(v, prompt, drafter=d, cfg=cfg).output_tokens

    ar = run(None, params)
    assert tuple(ar[6:14]) == end and ar != run(None, None)
    ref = prompt + ar
    for kw in [{}, {"wrong_at": range(200)}, {"wrong_at": (len(prompt) + 2, len(prompt) + 9)}]:
        assert run(ScriptedDrafter(ref, vocab=v.vocab_size, block_size=6, **kw), params) == ar, kw


@pytest.mark.hf
def test_the_servers_thinking_budget(tmp_path) -> None:
    """`thinking_budget` 4 on a template that opens the reasoning: at most 4 tokens of it; without the
    budget the same request reasons longer; a model without reasoning refuses the field."""
    pytest.importorskip("starlette")
    pytest.importorskip("transformers")
    import httpx
    from test_server import Served
    from tinymodels import tiny_llama, tiny_tokenizer

    from specdec.serve import build_app
    from specdec.stream import StreamingEngine
    from specdec.verifiers.hf import HFVerifier
    from specdec.verifiers.stub import StubVerifier

    model = tiny_tokenizer(tiny_llama(tmp_path / "llama"), chat_template=TEMPLATE, bos=1, eos=2)
    served = Served(build_app(StreamingEngine(HFVerifier(model))))
    body = {"messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 40,
            "structured_outputs": {"regex": "[a-z]*</think>\n[0-9]{3}"}}  # fmt: skip
    try:
        url = served.url + "/v1/chat/completions"
        free = httpx.post(url, json=body).json()["choices"][0]["message"]
        cut = httpx.post(url, json={**body, "thinking_budget": 4}).json()["choices"][0]["message"]
        assert len(free["reasoning_content"] or "") > 4, free  # else the test proves nothing
        assert len(cut["reasoning_content"]) <= 4 and len(cut["content"]) == 3, cut
    finally:
        served.stop()
    plain = Served(build_app(StreamingEngine(StubVerifier())))
    try:
        r = httpx.post(plain.url + "/v1/chat/completions", json={**body, "thinking_budget": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_budget", r.text
    finally:
        plain.stop()
