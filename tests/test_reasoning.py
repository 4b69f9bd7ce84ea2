"""A thinking model's reasoning apart from its answer (`specdec.reasoning`): the split of streamed text
(tags across deltas, a prompt that opened the reasoning, a reply without any), and the server's
`reasoning_content`, streamed and not, with `chat_template_kwargs` reaching the template."""

from __future__ import annotations

import random

import pytest

from specdec.reasoning import REASONING_SYNTAXES, ReasoningStream, detect_reasoning

THINK = REASONING_SYNTAXES["think"]
#: a thinking model's template (the `<think>` convention is a fact; this template is ours): the generation
#: prompt opens the reasoning unless enable_thinking is false
TEMPLATE = (
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is not defined or enable_thinking %}"
    "<think>\n{% endif %}{% endif %}{# a reply closes it with </think> #}"
)


def _split(pieces, opened=False):
    rs = ReasoningStream(THINK, opened=opened)
    out = [rs.push(p) for p in pieces] + [rs.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


def test_the_split_whatever_the_deltas() -> None:
    text = "<think>\nLet me see: 2 + 2.</think>\n\nIt is 4."
    rng = random.Random(0)
    for _ in range(50):  # cut anywhere, tags included
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, 12)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _split(pieces) == ("\nLet me see: 2 + 2.", "It is 4."), pieces
    assert _split(["Let me ", "think.</th", "ink>Done."], opened=True) == ("Let me think.", "Done.")
    assert _split(["  <th", "ink>a", "</think>b"]) == ("a", "b")
    assert _split(["No reasoning here."]) == ("", "No reasoning here.")
    assert _split(["<thi", "s is html>"]) == ("", "<this is html>")  # not the tag after all
    assert _split(["still thinking </thi"], opened=True) == ("still thinking </thi", "")  # cut short


def test_the_syntax_is_detected() -> None:
    assert detect_reasoning(TEMPLATE) is THINK
    assert detect_reasoning("{{ messages }}") is None and detect_reasoning(None) is None


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

    from specdec.drafting.lookup import PromptLookupDrafter
    from specdec.serve import build_app
    from specdec.stream import StreamingEngine
    from specdec.verifiers.hf import HFVerifier

    model = tiny_tokenizer(tiny_llama(tmp_path / "llama"), chat_template=TEMPLATE, bos=1, eos=2)
    served = Served(build_app(StreamingEngine(HFVerifier(model), PromptLookupDrafter(block_size=6))))
    try:
        url = served.url + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 40,
                "structured_outputs": {"regex": "[a-z]{6}</think>\n[0-9]{3}"}}  # fmt: skip
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
