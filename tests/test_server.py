"""`specdec serve` through the real OpenAI client against uvicorn on loopback (a random free port).

Reference outputs come from the Python API (`specdec.stream.StreamingEngine`) on a separate stub verifier.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from threads import at_once  # noqa: E402

from specdec.drafting.lookup.prompt import PromptLookupDrafter  # noqa: E402
from specdec.serve import build_app  # noqa: E402
from specdec.stream import StreamingEngine  # noqa: E402
from specdec.verifiers.stub import StubVerifier  # noqa: E402

BLOCK = 8


def _engine() -> StreamingEngine:
    return StreamingEngine(StubVerifier(), PromptLookupDrafter(block_size=BLOCK))


class Served:
    def __init__(self, app) -> None:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", **kw)

    def metrics(self) -> dict:
        return httpx.get(self.url + "/metrics").json()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _serve(engine: StreamingEngine, **kw) -> Iterator[Served]:
    s = Served(build_app(engine, **kw))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from _serve(_engine(), model_name="stub", max_queue=2)


@pytest.fixture(scope="module")
def ref() -> StreamingEngine:
    return _engine()


MSGS = [{"role": "user", "content": "Write a haiku about the sea."}]


def test_chat_non_streaming_and_streaming_match_the_python_api(served, ref):
    want = ref.complete(MSGS, max_tokens=48)
    client = served.client()
    r = client.chat.completions.create(model="stub", messages=MSGS, max_tokens=48)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.usage.completion_tokens == len(want.output_tokens)
    stats = r.model_extra["specdec"]
    assert {"acceptance_length_mean", "n_steps", "tokens_per_s", "drafted", "accepted"} <= set(stats)
    assert stats["n_steps"] == want.summary()["n_steps"] and stats["accepted"] == want.summary()["accepted"]

    chunks = list(
        client.chat.completions.create(
            model="stub", messages=MSGS, max_tokens=48, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.output_tokens)
    # the same conversation again was served from the cache (all but the prompt's last token)
    assert served.metrics()["reused_prompt_tokens_total"] >= want.prompt_tokens - 1


def test_completions_stop_strings_and_max_tokens(served, ref):
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
    full = ref.complete(prompt, max_tokens=60)
    assert len(full.text) > 12
    stop = full.text[8:11]  # a stop string that the output reaches (first occurrence at or before 8)
    cut = full.text[: full.text.index(stop)]
    client = served.client()
    r = client.completions.create(model="stub", prompt=prompt, max_tokens=60, stop=[stop, "\x00never"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="stub", prompt=prompt, max_tokens=60, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut
    r = client.completions.create(model="stub", prompt=prompt, max_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text == ref.complete(prompt, max_tokens=5).text


def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(served):
    url = served.url + "/v1/chat/completions"
    ok = {"model": "stub", "messages": MSGS, "max_tokens": 4}
    image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (json.dumps({**ok, "model": "gpt-9"}), 404, "does not exist"),
        (json.dumps({**ok, "messages": []}), 400, "non-empty list"),
        (json.dumps({**ok, "messages": "hi"}), 400, "non-empty list"),
        (json.dumps({**ok, "messages": [{"role": "user", "content": 5}]}), 400, "content"),
        (json.dumps({**ok, "messages": [{"role": "user", "content": image}]}), 400, "text prompts only"),
        (json.dumps({**ok, "temperature": "hot"}), 400, "'temperature' must be a number"),
        (json.dumps({**ok, "max_tokens": "10"}), 400, "'max_tokens' must be an integer"),
        (json.dumps({**ok, "max_tokens": 10**9}), 400, "maximum context length is 2048"),
        (json.dumps({**ok, "stop": 5}), 400, "'stop'"),
        (json.dumps({**ok, "stream": "yes"}), 400, "'stream'"),
        (json.dumps({**ok, "n": 2}), 400, "'n'"),
        (json.dumps({**ok, "top_p": 0}), 400, "top_p"),
        (json.dumps([1, 2]), 400, "JSON object"),
        # fields asking for what the server does not do are refused, not silently ignored
        (json.dumps({**ok, "logprobs": 3}), 400, "'logprobs' must be true or false"),
        (json.dumps({**ok, "top_logprobs": 2}), 400, "'top_logprobs' needs 'logprobs': true"),
        (json.dumps({**ok, "logprobs": True, "top_logprobs": 21}), 400, "'top_logprobs' must be in [0, 20]"),
        (json.dumps({**ok, "frequency_penalty": 2.5}), 400, "'frequency_penalty' must be in [-2, 2]"),
        (json.dumps({**ok, "repetition_penalty": 0}), 400, "'repetition_penalty' must be in (0, 100]"),
        (json.dumps({**ok, "logit_bias": {"x": 10}}), 400, "logit_bias keys must be token ids"),
        (json.dumps({**ok, "logit_bias": {"5": 101}}), 400, "logit_bias[5] must be in [-100, 100]"),
        (json.dumps({**ok, "logit_bias": {"999999": 1}}), 400, "outside the vocabulary"),
        (json.dumps({**ok, "logit_bias": [5, 10]}), 400, "'logit_bias' must be an object"),
        (json.dumps({**ok, "tools": [{"type": "function", "function": {"name": "f"}}]}), 400, "'tools'"),
        (json.dumps({**ok, "response_format": {"type": "xml"}}), 400, "'response_format' must be"),
    ]
    for body, status, words in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        assert words in r.json()["error"]["message"], (body, r.text)
    r = httpx.post(served.url + "/v1/completions", json={"model": "stub", "prompt": ""})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    assert httpx.get(served.url + "/v1/nothing").status_code == 404
    with pytest.raises(openai.NotFoundError):
        served.client().chat.completions.create(model="gpt-9", messages=MSGS)
    r = httpx.post(url, json=ok)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    asks_nothing = {"logprobs": False, "frequency_penalty": 0.0, "presence_penalty": 0, "tools": [],
                    "response_format": {"type": "text"}, "logit_bias": {}}  # fmt: skip
    r = httpx.post(url, json={**ok, **asks_nothing})  # what clients send by default is fine
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == _text(served, ok)


def test_bias_and_penalties_are_honoured_as_the_python_api_decodes(served) -> None:
    """A chat request with a bias and all three penalties: the text the Python API gives with the same
    `LogitsParams`, different from the plain text; a bad value names its field."""
    from specdec.processors import LogitsParams

    body = {"model": "stub", "messages": MSGS, "max_tokens": 24, "logit_bias": {"101": 3, "32": -100},
            "presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.4}  # fmt: skip
    got = _text(served, body)
    params = LogitsParams(logit_bias={101: 3, 32: -100}, presence_penalty=0.8, frequency_penalty=0.5,
                          repetition_penalty=1.4)  # fmt: skip
    want = _engine().complete(MSGS, max_tokens=24, logits=params).text
    assert got == want and got != _text(served, {"model": "stub", "messages": MSGS, "max_tokens": 24})
    url = served.url + "/v1/chat/completions"
    bad_fields = [
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"logit_bias": {"1e9": 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"penalty_context": 0}, "penalty_context"),
    ]
    for bad, param in bad_fields:
        r = httpx.post(url, json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_output_through_the_openai_client(served) -> None:
    """`response_format` json_schema and json_object, `structured_outputs` regex and choice (extra_body),
    streamed and not: the text the Python API gives under the same grammar, and it validates; a cut by
    max_tokens says `length`; a grammar that does not compile is a 400 naming its field."""
    jsonschema = pytest.importorskip("jsonschema")
    from specdec.grammar import GrammarSpec
    from specdec.processors import LogitsParams

    client, ref = served.client(), _engine()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for kw, spec in [
        ({"response_format": fmt}, GrammarSpec.json_schema(PERSON)),
        ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object")),
        ({"extra_body": {"structured_outputs": {"regex": "[a-c]{4}"}}}, GrammarSpec("regex", "[a-c]{4}")),
        (
            {"extra_body": {"structured_outputs": {"choice": ["up", "down"]}}},
            GrammarSpec.choice(["up", "down"]),
        ),
    ]:
        want = ref.complete(MSGS, max_tokens=80, logits=LogitsParams(grammar=spec))
        r = client.chat.completions.create(model="stub", messages=MSGS, max_tokens=80, **kw)
        assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop", kw
        chunks = client.chat.completions.create(model="stub", messages=MSGS, max_tokens=80, stream=True, **kw)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    jsonschema.validate(
        json.loads(
            client.chat.completions.create(model="stub", messages=MSGS, max_tokens=80, response_format=fmt)
            .choices[0]
            .message.content
        ),
        PERSON,
    )
    cut = client.chat.completions.create(model="stub", messages=MSGS, max_tokens=3, response_format=fmt)
    assert cut.choices[0].finish_reason == "length"
    url = served.url + "/v1/chat/completions"
    body = {"model": "stub", "messages": MSGS, "max_tokens": 8}
    rf, so = "response_format", "structured_outputs"
    for bad, param, words in [
        ({rf: {"type": "json_schema", "json_schema": {"name": "x"}}}, rf, "schema"),
        ({rf: {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, rf, "does not compile"),
        ({so: {"regex": "[a-"}}, so, "does not compile"),
        ({so: {"regex": "a", "choice": ["b"]}}, so, "exactly one"),
        ({so: {"regex": "a"}, rf: {"type": "json_object"}}, so, "not both"),
    ]:
        r = httpx.post(url, json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        assert words in r.json()["error"]["message"] and "\n" not in r.json()["error"]["message"], r.text
    assert httpx.post(url, json=body).status_code == 200  # still serving


def test_logprobs_through_the_openai_client(served) -> None:
    """Chat `logprobs` + `top_logprobs` and completions `logprobs`, streamed and not: the Python API's
    entries (the stop token left out), each token's text spelling the content."""
    from specdec.records import token_logprobs

    client, ref = served.client(), _engine()
    want = ref.complete(MSGS, max_tokens=24, logprobs=3)
    entries = token_logprobs(want.steps)
    if want.finish_reason == "stop":
        entries = entries[:-1]
    r = client.chat.completions.create(
        model="stub", messages=MSGS, max_tokens=24, logprobs=True, top_logprobs=3
    )
    got = r.choices[0].logprobs.content  # (the server's cache may hold the prompt: fp32 rounds apart)
    assert [g.logprob for g in got] == pytest.approx([e.logprob for e in entries], abs=1e-5)
    tops = [[t.logprob for t in g.top_logprobs] for g in got]
    assert tops == [pytest.approx([p for _, p in e.top], abs=1e-5) for e in entries]
    # a token may hold part of a character: its `bytes` put together spell the content
    assert bytes(b for g in got for b in g.bytes).decode("utf-8", "replace") == r.choices[0].message.content
    assert r.choices[0].message.content == want.text
    chunks = client.chat.completions.create(model="stub", messages=MSGS, max_tokens=24, logprobs=True,
                                            top_logprobs=3, stream=True)  # fmt: skip
    streamed = [c for c in chunks if c.choices and c.choices[0].logprobs]
    got = [g.logprob for c in streamed for g in c.choices[0].logprobs.content]
    assert got == pytest.approx([e.logprob for e in entries], abs=1e-5)
    plain = client.chat.completions.create(model="stub", messages=MSGS, max_tokens=8)
    assert plain.choices[0].logprobs is None
    c = client.completions.create(model="stub", prompt="Once upon", max_tokens=12, logprobs=2)
    want = ref.complete("Once upon", max_tokens=12, logprobs=2)
    lp = c.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(
        [e.logprob for e in token_logprobs(want.steps)][: len(lp.token_logprobs)], abs=1e-5
    )
    assert len(lp.tokens) == len(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(t) == 2 for t in lp.top_logprobs)
    r = httpx.post(served.url + "/v1/completions", json={"model": "stub", "prompt": "x", "logprobs": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def _text(served, body: dict) -> str:
    return httpx.post(served.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"][
        "content"
    ]


def test_models_health_metrics(served):
    assert [m.id for m in served.client().models.list()] == ["stub"]
    assert httpx.get(served.url + "/health").json()["status"] == "ok"
    served.client().chat.completions.create(model="stub", messages=MSGS, max_tokens=8)
    m = served.metrics()
    assert m["requests_completed"] >= 1 and m["acceptance_length_mean"] >= 1
    assert m["tokens_per_s"] > 0 and "verifier" in m["peak_memory"]
    assert m["running"] == 0 and m["queue_depth"] == 0 and m["busy"] is False
    # one engine alone: every decode step's verify ran one request's calls
    assert m["decode_steps_by_batch_size"] == {"1": m["decode_steps_total"]} and m["decode_steps_total"]
    text = httpx.get(served.url + "/metrics?format=prometheus").text
    assert "# TYPE specdec_requests_completed_total counter" in text
    assert "specdec_acceptance_length_mean " in text
    assert 'specdec_peak_memory_bytes{runtime="verifier"}' in text
    assert "specdec_running 0" in text and "specdec_prompt_cache_hits_total " in text
    assert f'specdec_decode_steps_by_batch_size_total{{batch_size="1"}} {m["decode_steps_total"]}' in text


def test_a_conversations_next_turn_goes_to_the_engine_holding_its_start():
    """Two free engines (each on its own stub): turn 1 of a chat runs on one; turn 2 (turn 1, its reply, a
    new question) goes to the engine whose cache holds turn 1, so its prefill reuses at least turn 1's
    prompt. Arrival order alone would hand it to the engine that has waited longest: the other one."""
    serving = _serve([_engine(), _engine()], model_name="stub")
    served = next(serving)
    client = served.client(max_retries=0, timeout=60)
    worker = served.app.state.worker
    # turn 1 on the second engine: the first is busy with another request meanwhile (so neither "the
    # first free engine" nor "the one waiting longest" would pick the second for turn 2 by chance)
    other = [{"role": "user", "content": "Count slowly."}]
    busy = threading.Thread(
        target=lambda: client.chat.completions.create(model="stub", messages=other, max_tokens=400)
    )
    busy.start()
    deadline = time.time() + 20
    while not worker.running:
        assert time.time() < deadline
        time.sleep(0.001)
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    r1 = client.chat.completions.create(model="stub", messages=msgs, max_tokens=16, temperature=0)
    busy.join()
    before = served.metrics()
    msgs += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And the sky?"},
    ]
    client.chat.completions.create(model="stub", messages=msgs, max_tokens=16, temperature=0)
    after = served.metrics()
    serving.close()
    assert (
        after["reused_prompt_tokens_total"] - before["reused_prompt_tokens_total"]
        >= r1.usage.prompt_tokens
        > 0
    )
    assert after["prompt_cache_hits_total"] == before["prompt_cache_hits_total"] + 1


@pytest.mark.parametrize("max_queue", [2, 8])
def test_eight_concurrent_clients_none_lost_or_mixed(max_queue, ref):
    prompts = [f"Client {i} asks: what is {i} plus {i}?" for i in range(8)]
    want = [ref.complete([{"role": "user", "content": p}], max_tokens=40).text for p in prompts]
    got: dict[int, object] = {}
    served = next(serving := _serve(_engine(), model_name="stub", max_queue=max_queue))

    def ask(i: int) -> None:
        client = served.client(max_retries=0, timeout=60)
        try:
            r = client.chat.completions.create(
                model="stub", messages=[{"role": "user", "content": prompts[i]}], max_tokens=40
            )
            got[i] = r.choices[0].message.content
        except openai.APIStatusError as e:
            got[i] = e

    at_once(ask, 8)
    serving.close()
    assert sorted(got) == list(range(8))  # none lost
    served_ok = [i for i, v in got.items() if isinstance(v, str)]
    busy = [v for v in got.values() if not isinstance(v, str)]
    assert all(got[i] == want[i] for i in served_ok)  # none mixed
    assert all(e.status_code == 503 and "server busy" in e.message for e in busy)
    assert len(served_ok) >= min(8, max_queue + 1)  # the running one plus a full queue at least
    print(f"\n8 concurrent clients: {len(served_ok)} served, {len(busy)} got 503 (max_queue {max_queue})")


def test_disconnect_cancels_and_the_next_request_is_served(served, ref):
    before = served.metrics()["requests_cancelled"]
    body = {"model": "stub", "prompt": "Hello", "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
    deadline = time.time() + 10
    while served.metrics()["requests_cancelled"] == before:
        assert time.time() < deadline, "the disconnected stream was not cancelled"
        time.sleep(0.02)
    last = served.metrics()["last_request"]
    assert last["finish_reason"] == "cancelled" and last["completion_tokens"] < 1500
    # a non-streaming client that gives up is cancelled too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(served.url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
    deadline = time.time() + 10
    while served.metrics()["requests_cancelled"] < before + 2:
        assert time.time() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.02)
    r = served.client().completions.create(model="stub", prompt="Hello", max_tokens=20)
    assert r.choices[0].text == ref.complete("Hello", max_tokens=20).text


def test_streaming_detokenisation_of_emoji_cjk_equals_non_streaming():
    from test_stream import MIXED, ScriptVerifier

    from specdec.verifiers.stub import ByteTokenizer

    prompt = "user: say it\nassistant:"
    ids = ByteTokenizer().encode(prompt)
    v = ScriptVerifier(list(MIXED.encode()))
    v.n_prompt = len(ids)
    for s in _serve(StreamingEngine(v), model_name="script"):
        client = s.client()
        msgs = [{"role": "user", "content": "say it"}]
        whole = client.chat.completions.create(model="script", messages=msgs, max_tokens=400)
        parts = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="script", messages=msgs, max_tokens=400, stream=True
            )
            if c.choices
        ]
        assert whole.choices[0].message.content == "".join(parts) == MIXED
        assert not any("\ufffd" in p for p in parts) and len([p for p in parts if p]) > 10


@pytest.mark.slow
def test_smollm2_server_matches_python_api(capsys):
    pytest.importorskip("transformers")
    from specdec.api import load_verifier

    v = load_verifier("hf", "smollm2-135m")
    msgs = [{"role": "user", "content": "List three facts about octopuses, one per line."}]
    api = StreamingEngine(v, PromptLookupDrafter(block_size=BLOCK))
    want = api.complete(msgs, max_tokens=96)
    api.reset()
    t0 = time.perf_counter()
    want = api.complete(msgs, max_tokens=96)
    api_wall = time.perf_counter() - t0
    api.reset()
    for s in _serve(api, model_name="smollm2"):
        client = s.client()
        t0 = time.perf_counter()
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=96)
        http_wall = time.perf_counter() - t0
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="smollm2", messages=msgs, max_tokens=96, stream=True
            )
            if c.choices
        )
    assert r.choices[0].message.content == streamed == want.text
    n = len(want.output_tokens)
    with capsys.disabled():
        print(
            f"\n[smollm2-135m] {n} tokens: python API {want.summary()['tokens_per_s']:.1f} tok/s decode, "
            f"{n / api_wall:.1f} tok/s wall; server {r.model_extra['specdec']['tokens_per_s']:.1f} tok/s "
            f"decode, {n / http_wall:.1f} tok/s wall (HTTP round trip included)"
        )


@pytest.mark.parametrize("runtime", ["hf", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_max_batch_eight_streaming_clients_each_get_their_solo_text(tmp_path, runtime):
    """`--max-batch 4`: four engines on sequences of one batch (tiny Llama: HF in bf16, MLX in fp32), eight
    streaming clients at once, each with its own prompt and sampling: each gets the text its request gives
    alone on the plain verifier. Where this machine's verify is not batch-invariant the batch is refused."""
    import tinymodels
    import torch

    from specdec.sampling import SamplingParams
    from specdec.verifiers.hf import HFVerifier

    folder = tinymodels.tiny_tokenizer(tinymodels.tiny_llama(tmp_path / "llama"), bos=1, eos=2)
    if runtime == "hf":
        make = lambda: HFVerifier(folder, dtype=torch.bfloat16)  # noqa: E731
    else:
        pytest.importorskip("mlx_lm")
        from specdec.verifiers.mlx import MLXVerifier

        make = lambda: MLXVerifier(folder, dtype="float32")  # noqa: E731
    from measured import batch_or_refused, shared

    batch = batch_or_refused(make())
    if batch is None:
        return
    engines = [StreamingEngine(batch.sequence(), PromptLookupDrafter(block_size=BLOCK)) for _ in range(4)]
    prompts = [f"client {i}: " + "abc " * (i + 2) for i in range(8)]
    temps = [0.0 if i % 2 else 0.8 for i in range(8)]
    solo = StreamingEngine(make(), PromptLookupDrafter(block_size=BLOCK))
    want = [
        solo.complete(p, max_tokens=24, sampling=SamplingParams(temperature=t, seed=7)).text
        for p, t in zip(prompts, temps, strict=True)
    ]
    got: dict[int, str] = {}
    since = batch.forwards.copy()
    serving = _serve(engines, model_name="tiny", max_queue=8)
    served = next(serving)

    def ask(i: int) -> None:
        client = served.client(max_retries=0, timeout=120)
        parts = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=24, stream=True,
                                          temperature=temps[i], seed=7)  # fmt: skip
        got[i] = "".join(c.choices[0].text for c in parts if c.choices)

    at_once(ask, 8)
    sizes = served.metrics()["decode_steps_by_batch_size"]
    serving.close()
    assert [got.get(i) for i in range(8)] == want and all(want)
    assert shared(batch, since) > 1  # the requests' verifies did share forwards
    assert max(map(int, sizes)) > 1  # and the requests' own steps say so in /metrics


def test_max_batch_is_refused_where_it_cannot_run(capsys):
    from specdec.cli import main

    tree = ["serve", "--verifier", "stub", "--drafter", "prompt-lookup", "--tree", "4", "--port", "0"]
    assert main([*tree, "--max-batch", "2"]) == 2
    assert "--max-batch verifies chains: drop --tree" in capsys.readouterr().err
    assert main(["serve", "--verifier", "stub", "--dtype", "float32", "--max-batch", "2", "--port", "0"]) == 2
    assert "its float32 verify is not batch-invariant here" in capsys.readouterr().err


def test_serve_cuts_a_bundled_drafters_drafts_by_cost_on_a_cpu_unless_told():
    """As the main job: on a CPU a bundled drafter's chains are cut where they pay (`--min-confidence
    auto`, measured at start); a value given, another drafter, another device or trees keep theirs."""
    import argparse

    from specdec.serve.cli import _min_confidence, add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    bundled = ["--drafter", "bundled:smollm2-135m+lookup"]
    cases = [
        (bundled, "auto"), ([*bundled, "--min-confidence", "0.3"], 0.3), ([], 0.0),
        ([*bundled, "--device", "mps"], 0.0), ([*bundled, "--tree", "4"], 0.0),
    ]  # fmt: skip
    for argv, want in cases:
        assert _min_confidence(p.parse_args(argv)) == want, argv
