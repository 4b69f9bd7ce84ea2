"""The token-id training corpus: batched greedy generation equals the runtime's own, builds resume exactly,
and the committed prompts share no word 8-gram with HumanEval or MT-Bench."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tinymodels import tiny_gemma3, tiny_llama, tiny_qwen3

from specdec.train.corpus import Corpus, build_stage
from specdec.verifiers.stub import StubVerifier

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3, tiny_qwen3], ids=["llama", "gemma3", "qwen3"])
def test_continuous_batching_equals_generate(tmp_path, make):
    from specdec.verifiers.hf import HFVerifier
    from specdec.verifiers.hf_generate import generate_many

    v = HFVerifier(make(tmp_path / "m"))  # gemma3: window 16, passed by the longer rows
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 30, (11,), generator=g).tolist()
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]
    budgets = torch.randint(1, 40, (11,), generator=g).tolist()
    items = [(i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets))]
    # 4 rows for 11 prompts: rows are refilled, prefilled in length groups, and drain at the end
    got = dict(generate_many(v.model, items, stop_ids=frozenset({7, 9}), rows=4, max_len=80))
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        ref = v.model.generate(
            torch.tensor([p]), max_new_tokens=b, do_sample=False, eos_token_id=[7, 9], pad_token_id=0
        )[0, len(p) :].tolist()
        assert got[i] == ref, i


def _prompts(n: int) -> list[tuple[str, list[dict[str, str]]]]:
    return [(f"p{i}", [{"role": "user", "content": f"prompt number {i} " * (1 + i % 3)}]) for i in range(n)]


def _encode(v):
    from specdec.chat import encode_prompt

    return lambda m: encode_prompt(v, m)


def test_build_resumes_after_an_interruption_exactly(tmp_path):
    v = StubVerifier()
    whole = Corpus.create(tmp_path / "whole", v, max_len=120)
    whole.start_stage("s", lambda: _prompts(8), budget=10, chunk_size=3)
    assert build_stage(whole, v, "s", encode=_encode(v), progress=False) == 3

    part = Corpus.create(tmp_path / "part", v, max_len=120)
    part.start_stage("s", lambda: _prompts(8), budget=10, chunk_size=3)
    assert build_stage(part, v, "s", encode=_encode(v), max_chunks=1, progress=False) == 1
    import specdec.train.corpus as corpus

    real, seen, asked = corpus._answers, [], []

    def dies(verifier, items, **kw):  # the process is killed in the middle of the second chunk
        for x in real(verifier, items, **kw):
            seen.append(x)
            if len(seen) == 3:
                raise KeyboardInterrupt
            yield x

    def counts(verifier, items, **kw):
        return real(verifier, (asked.append(it[0]) or it for it in items), **kw)

    corpus._answers = dies
    try:
        with pytest.raises(KeyboardInterrupt):
            build_stage(part, v, "s", encode=_encode(v), progress=False)
        assert part.missing_chunks("s") == [1, 2]  # no chunk half-written
        assert part.partial_path("s").is_file()  # the two answers of chunk 1 are kept
        assert len(list(part.sequences("s"))) == 3  # readers see whole chunks only
        part = Corpus(tmp_path / "part")  # a fresh process
        corpus._answers = counts
        assert build_stage(part, v, "s", encode=_encode(v), progress=False) == 2
    finally:
        corpus._answers = real
    assert asked == [5, 6, 7]  # prompts 3 and 4 were answered before the interruption
    assert not part.partial_path("s").exists()
    a, b = list(whole.sequences("s")), list(part.sequences("s"))
    assert [s.key for s in a] == [s.key for s in b] == [f"p{i}" for i in range(8)]
    assert all(np.array_equal(x.ids, y.ids) and x.prompt_len == y.prompt_len for x, y in zip(a, b))
    stats = part.stats()["s"]
    assert stats["n_sequences"] == 8 and stats["response_tokens"] > 0


def test_a_partial_file_of_other_prompts_is_refused(tmp_path):
    v = StubVerifier()
    a = Corpus.create(tmp_path / "a", v, max_len=120)
    a.start_stage("s", lambda: _prompts(8), budget=10, chunk_size=3)
    b = Corpus.create(tmp_path / "b", v, max_len=120)
    b.start_stage(
        "s", lambda: [(f"q{i}", m) for i, (_, m) in enumerate(_prompts(8))], budget=10, chunk_size=3
    )
    from specdec.train import corpus

    corpus._save_partial(a.partial_path("s"), {1: {3: ("p3", [1, 2], [3])}})
    (tmp_path / "b" / "s" / "partial.npz").write_bytes(a.partial_path("s").read_bytes())
    with pytest.raises(ValueError, match="does not belong to this stage's prompts"):
        build_stage(b, v, "s", encode=_encode(v), progress=False)
    assert build_stage(a, v, "s", encode=_encode(v), progress=False) == 3  # its own stage resumes from it


def test_stage_prompts_are_fixed_once_and_settings_checked(tmp_path):
    v = StubVerifier()
    c = Corpus.create(tmp_path, v, max_len=64)
    calls = []
    c.start_stage("s", lambda: calls.append(1) or _prompts(2), budget=4, chunk_size=2)
    c.start_stage("s", lambda: calls.append(1) or _prompts(5), budget=4, chunk_size=2)  # already fixed
    assert calls == [1] and len(Corpus(tmp_path).prompts("s")) == 2
    with pytest.raises(ValueError, match="budget"):
        c.start_stage("s", lambda: _prompts(2), budget=8, chunk_size=2)

    other = StubVerifier()
    other.model_name = "another"
    with pytest.raises(ValueError, match="another verifier"):
        Corpus.create(tmp_path, other, max_len=64)
    with pytest.raises(FileNotFoundError, match="not a corpus"):
        Corpus(tmp_path / "nothing")


def test_a_prompt_too_long_for_the_corpus_gets_an_empty_answer(tmp_path):
    v = StubVerifier()
    c = Corpus.create(tmp_path, v, max_len=40)
    long = [("long", [{"role": "user", "content": "x" * 60}]), *_prompts(2)]
    c.start_stage("s", lambda: long, budget=5, chunk_size=2)
    build_stage(c, v, "s", encode=_encode(v), progress=False)
    got = {s.key: len(s.ids) - s.prompt_len for s in c.sequences("s")}
    assert got["long"] == 0 and got["p0"] > 0 and not c.missing_chunks("s")


def test_parse_instruction():
    from specdec.train.prompts import parse_instruction

    assert parse_instruction('A nurse might ask: "How do I read a blood test report?"') == (
        "How do I read a blood test report?"
    )
    assert (
        parse_instruction("Question: how do bees make honey in winter?")
        == "how do bees make honey in winter?"
    )
    assert parse_instruction("Sure!") is None and parse_instruction("```python\nx = 1\n```") is None
    # a base model (Gemma-3-270M here) repeats the request instead of answering it
    ask = "Write one question that a photographer might ask an AI assistant about earthquakes."
    assert parse_instruction(f"{ask} Write only the question. mendatang\npaying", ask) is None
    got = "How do I photograph the damage an earthquake leaves safely?"
    assert parse_instruction(f'A photographer might ask: "{got}"', ask) == got


def test_committed_prompts_share_no_8_gram_with_the_eval_sets():
    from specdec.train.prompts import eval_ngrams, word_ngrams

    files = sorted((REPO / "specdec" / "bundled").glob("*/corpus/*/prompts.jsonl.gz"))
    assert files, "the bundled corpora's prompts are committed"
    banned = eval_ngrams()
    assert len(banned) > 10_000  # both eval sets were read
    n = 0
    for f in files:
        for line in gzip.decompress(f.read_bytes()).decode().splitlines():
            rec = json.loads(line)
            for m in rec["messages"]:
                if m["role"] == "user":
                    hit = word_ngrams(m["content"]) & banned
                    assert not hit, (f.name, rec["key"], sorted(hit)[:3])
                    n += 1
    assert n > 1000


def test_module_entry_point_runs_without_a_double_import():
    # `python -m specdec.train.corpus` once warned (runpy) that the package had already imported the module.
    import subprocess
    import sys

    cmd = [sys.executable, "-W", "error::RuntimeWarning", "-m", "specdec.train.corpus", "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m specdec.train.corpus" in out.stdout and out.stderr == ""
