"""The policy replay (`specdec.evals.replay`) against the engine: same steps, same τ, for DFlash blocks cut
at several confidences, with and without prompt lookup."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
import torch
from test_dflash import make_model, stub_cfg

from specdec.drafting.dflash.torch import DFlashDrafter
from specdec.drafting.lookup.ngrams import CorpusNgrams
from specdec.drafting.mix import LookupFirstDrafter
from specdec.drafting.policy import DraftPolicy
from specdec.engine import DecodeConfig, generate
from specdec.evals.replay import Position, Trace, first_draft_agreement, measure_costs, record, replay
from specdec.verifiers.stub import StubVerifier


def engine_tau(verifier, model, prompt, *, p, lookup, n):
    drafter = DFlashDrafter(model, policy=DraftPolicy(min_confidence=p))
    drafter.bind(verifier)
    bs = 16 if lookup else drafter.block_size
    if lookup:
        drafter = LookupFirstDrafter(drafter, block_size=16)
    res = generate(verifier, prompt, drafter=drafter, cfg=DecodeConfig(max_new_tokens=n, block_size=bs))
    steps = res.decode_steps
    return statistics.mean(s.acceptance_length for s in steps), len(steps), res.output_tokens, bs


def check(verifier, model, prompt, n, ps):
    base = generate(verifier, prompt, cfg=DecodeConfig(max_new_tokens=n, block_size=1)).output_tokens
    drafter = DFlashDrafter(model)
    drafter.bind(verifier)
    trace = record(verifier, drafter, prompt, base)
    assert len(trace.positions) == len(base) - 1
    for lookup in (False, True):
        for p in ps:
            tau, steps, out, bs = engine_tau(verifier, model, prompt, p=p, lookup=lookup, n=n)
            assert out == base
            r = replay([trace], min_confidence=p, lookup=lookup, block_size=bs, max_new_tokens=n)
            assert (r.steps, r.tokens) == (steps, len(base) - 1), (p, lookup)
            assert r.tau == pytest.approx(tau), (p, lookup)
    alone = LookupFirstDrafter(DFlashDrafter(model), block_size=16).lookup  # its lookup half, alone
    res = generate(verifier, prompt, drafter=alone, cfg=DecodeConfig(max_new_tokens=n, block_size=16))
    assert res.output_tokens == base
    r = replay([trace], min_confidence=0.0, dflash=False, block_size=16, max_new_tokens=n)
    steps = res.decode_steps
    assert (r.steps, r.tau) == (
        len(steps),
        pytest.approx(statistics.mean(s.acceptance_length for s in steps)),
    )
    return trace


def test_replay_equals_the_engine_on_the_stub():
    verifier = StubVerifier()
    model = make_model(stub_cfg())
    prompt = verifier.tokenizer.encode("speculative decoding, exactly; speculative decoding, exactly")
    probe = DFlashDrafter(model)
    probe.bind(verifier)
    n = 48
    first = [
        p.confidence[0]
        for p in record(verifier, probe, prompt, generate(verifier, prompt, cfg=DecodeConfig(
            max_new_tokens=n, block_size=1)).output_tokens).positions
    ]  # fmt: skip
    qs = statistics.quantiles(first, n=4)  # cut points that split the steps
    trace = check(verifier, model, prompt, n, [0.0, *qs])
    assert any(p.lookup for p in trace.positions)  # the lookup path was exercised


def test_first_draft_agreement_and_policies():
    out = [5, 1, 2, 3, 4]
    pos = [
        Position((1, 9), (0.9, 0.1), (1, 2)),  # both right
        Position((7, 9), (0.9, 0.1), ()),  # DFlash wrong, no lookup
        Position((3, 9), (0.9, 0.1), (8,)),  # lookup wrong
        Position((9, 9), (0.9, 0.1), ()),
    ]
    got = first_draft_agreement([Trace("x", out, pos)])
    assert got == {"positions": 4, "dflash": 0.5, "lookup": 0.5, "lookup_coverage": 0.5}
    with pytest.raises(ValueError, match="lookup, corpus n-grams, DFlash or a mix"):
        replay([Trace("x", out, pos)], min_confidence=0.0, lookup=False, dflash=False)


def test_costs_and_estimated_speedup():
    verifier = StubVerifier()
    drafter = DFlashDrafter(make_model(stub_cfg()))
    drafter.bind(verifier)
    costs, draft_s = measure_costs(verifier, drafter, context=20, sizes=(1, 4, 16), reps=2)
    assert set(costs) == {1, 4, 16} and all(c > 0 for c in costs.values()) and draft_s > 0
    prompt = verifier.tokenizer.encode("abcabcabc")
    out = generate(verifier, prompt, cfg=DecodeConfig(max_new_tokens=24, block_size=1)).output_tokens
    trace = record(verifier, drafter, prompt, out)
    flat = {1: 1.0, 16: 1.0}  # a verify of any length costs one step and the drafter is free
    r = replay([trace], min_confidence=0.0, lookup=True, costs=flat)
    assert r.est_speedup == pytest.approx(r.tau)  # every step commits τ tokens on average
    assert replay([trace], min_confidence=0.0).est_speedup is None


@pytest.mark.slow
def test_replay_equals_the_engine_on_smollm2():
    from specdec.api import bundled_drafter
    from specdec.chat import encode_prompt
    from specdec.evals.datasets import load_humaneval
    from specdec.models import fetch
    from specdec.verifiers.hf import HFVerifier

    verifier = HFVerifier(fetch("smollm2-135m"))
    model = DFlashDrafter.from_pretrained(bundled_drafter("smollm2-135m")).model
    prompt = encode_prompt(verifier, load_humaneval(limit=1)[0].messages)
    trace = check(verifier, model, prompt, 48, [0.0, 0.4, 0.8])
    assert max(len(p.lookup) for p in trace.positions) > 0
    assert max(p.confidence[0] for p in trace.positions) > 0.5  # a trained drafter: confident somewhere


def test_failures_are_clear_and_early(tmp_path, capsys):
    from specdec.evals.replay import main

    verifier = StubVerifier()
    with pytest.raises(RuntimeError, match="not bound"):
        record(verifier, DFlashDrafter(make_model(stub_cfg())), [1, 2, 3], [4, 5])
    (tmp_path / "f").write_text("")
    assert main(["--verifier", "stub", "--out", str(tmp_path / "f" / "r.json")]) == 2  # before any load
    assert "is not a directory" in capsys.readouterr().err
    assert main(["--verifier", "stub", "--drafter", "prompt-lookup"]) == 2
    assert "give a DFlash drafter" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # nothing written


def test_several_drafters_share_the_answers_and_replay_as_alone(tmp_path):
    import json

    from specdec.evals.replay import main

    a = DFlashDrafter(make_model(stub_cfg(block_size=4), seed=1)).save_pretrained(tmp_path / "a")
    b = DFlashDrafter(make_model(stub_cfg(), seed=2)).save_pretrained(tmp_path / "b")
    base = ["--verifier", "stub", "--dataset", "mtbench", "--limit", "1", "--max-new-tokens", "64",
            "--grid", "0", "0.5"]  # fmt: skip
    both, alone = tmp_path / "both.json", tmp_path / "alone.json"
    assert main([*base, "--drafter", str(a), str(b), "--out", str(both)]) == 0
    assert main([*base, "--drafter", str(b), "--out", str(alone)]) == 0
    got = json.loads(both.read_text())["drafters"]
    assert [d["drafter"] for d in got] == [str(a), str(b)]
    taus = lambda d: [(r["min_confidence"], r["lookup"], r["tau"], r["steps"]) for r in d["results"]]  # noqa: E731
    assert taus(got[1]) == taus(json.loads(alone.read_text())["drafters"][0])
    assert taus(got[0]) != taus(got[1])  # block 4 vs 8: each drafter replayed with its own traces


def _table(**rel):
    return {"relative": {"128": {k.removeprefix("b"): v for k, v in rel.items()}}}


@pytest.mark.parametrize(
    ("rel", "block"),
    [
        (dict(b1=1, b2=1.02, b4=1.03, b8=1.06, b16=1.15), 16),  # GPU-like: whole blocks
        (dict(b1=1, b2=1.16, b4=1.21, b8=1.30, b16=1.56), 16),  # the Xeon CI CPU in fp32 (issue 17)
        (dict(b1=1, b2=1.1, b4=1.2, b8=3.6), 4),  # rows 5..8 cost 0.6 each: stop at 4
        (dict(b1=1, b2=1.9, b4=3.5), 2),  # a second row costs 0.9: one draft
    ],
)
def test_auto_block_from_a_cost_table(rel, block):
    from specdec.costs import VerifyCosts, choose_block

    costs = VerifyCosts.from_table(_table(**rel), source="t")
    got, why = choose_block(costs, max_block=16)
    assert got == block and "one-token step" in why
    assert choose_block(costs, max_block=8)[0] == min(block, 8)


def test_auto_options_on_the_cli(tmp_path, capsys):
    import json

    from specdec.cli import main

    ckpt = DFlashDrafter(make_model(stub_cfg())).save_pretrained(tmp_path / "ckpt")
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(_table(b1=1, b2=1.1, b4=1.2, b8=3.6)))
    base = ["generate", "--verifier", "stub", "--drafter", str(ckpt), "--prompt", "hello",
            "--max-new-tokens", "6"]  # fmt: skip
    out = tmp_path / "r.json"
    auto = ["--block-size", "auto", "--min-confidence", "auto"]
    assert main([*base, *auto, "--costs", str(costs), "--out", str(out)]) == 0, capsys.readouterr().err
    cfg = json.loads(out.read_text())["config"]
    err = capsys.readouterr().err
    assert "block size 4" in err and "drafts cut where they commit the most tokens per verify cost" in err
    assert cfg["block_size"] == 4 and cfg["drafter"]["min_confidence"] == 0.0
    assert cfg["drafter"]["costs"]["source"] == str(costs) and cfg["drafter"]["costs"]["relative"][3] == 1.2
    # without a table the verifier's verifies are timed at load; a +lookup drafter cuts its drafts too
    argv = [*base, "--drafter", f"{ckpt}+lookup", "--min-confidence", "auto", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    cfg = json.loads(out.read_text())["config"]
    assert cfg["drafter"]["costs"]["source"] == "measured" and cfg["block_size"] == 16
    for extra, msg in [
        (["--costs", str(costs)], "read only with --block-size auto"),
        (["--block-size", "auto", "--costs", str(tmp_path)], "cannot read a JSON cost table"),
        (["--min-confidence", "auto", "--costs", str(ckpt / "config.json")], "no 'relative' costs"),
        (["--min-confidence", "auto", "--drafter", "prompt-lookup"], "need a DFlash drafter"),
    ]:
        assert main([*base, *extra]) == 2
        assert msg in capsys.readouterr().err


def test_load_drafter_takes_costs_or_min_confidence_not_both():
    from specdec.api import load_drafter
    from specdec.costs import VerifyCosts

    v, costs = StubVerifier(), VerifyCosts((1.0, 1.0), "t")
    with pytest.raises(ValueError, match="not both"):
        load_drafter("bundled:smollm2-135m", verifier=v, min_confidence=0.2, costs=costs)
    with pytest.raises(ValueError, match="verify costs cut block drafts"):
        load_drafter("prompt-lookup", verifier=v, costs=costs)


def test_corpus_policy_equals_the_engine_on_the_stub():
    verifier = StubVerifier()
    cfg = DecodeConfig(max_new_tokens=40, block_size=1)
    answers = [  # the corpus: the verifier's own answers to other prompts
        generate(verifier, verifier.tokenizer.encode(t), cfg=cfg).output_tokens
        for t in ("speculative", "decoding is exact", "a b c d", "drafts and verifies")
    ]
    table = CorpusNgrams(answers, max_order=4, min_count=1)
    prompt = verifier.tokenizer.encode("speculative decoding")
    base = generate(verifier, prompt, cfg=cfg).output_tokens
    drafter = DFlashDrafter(make_model(stub_cfg()))
    drafter.bind(verifier)
    trace = record(verifier, drafter, prompt, base, corpus=table)
    assert any(p.corpus and not p.lookup for p in trace.positions)  # the corpus path is exercised
    for cut in (0.0, 0.5, 0.9):
        for p in (0.0, 1.0):  # whole DFlash blocks after the corpus; none (nothing reaches confidence 1)
            inner = DFlashDrafter(drafter.model, policy=DraftPolicy(min_confidence=p))
            inner.bind(verifier)
            engine = LookupFirstDrafter(
                inner, block_size=16, corpus=table, policy=DraftPolicy(corpus_cut=cut)
            )
            res = generate(verifier, prompt, drafter=engine, cfg=replace(cfg, block_size=16))
            assert res.output_tokens == base
            assert engine.counts["corpus"] > 0 and engine.name.endswith("+lookup+corpus")
            r = replay([trace], min_confidence=p, corpus=cut, block_size=16, max_new_tokens=40)
            steps = res.decode_steps
            assert (r.steps, r.tau) == (
                len(steps),
                pytest.approx(statistics.mean(s.acceptance_length for s in steps)),
            ), (cut, p)


@pytest.mark.parametrize(
    "relative",
    [
        (1.0, 1.0),  # GPU-like: every draft is free, whole proposals
        (1.0, 0.9, 1.2, 1.05, 1.4, 1.7, 1.8),  # a small CPU in fp32: steps at 3 and 5+ tokens
        (1.0, 1.6, 2.2),  # a second token costs most of a step: only sure drafts
    ],
)
def test_cost_cut_policy_equals_the_engine_on_the_stub(relative):
    """`--min-confidence auto`: lookup, corpus and DFlash drafts cut by verify costs, the better of lookup
    and corpus proposed; the engine against the replay's walk, and exact."""
    from specdec.costs import VerifyCosts

    verifier = StubVerifier()
    cfg = DecodeConfig(max_new_tokens=40, block_size=1)
    answers = [
        generate(verifier, verifier.tokenizer.encode(t), cfg=cfg).output_tokens
        for t in ("speculative", "decoding is exact", "a b c d", "drafts and verifies")
    ]
    table = CorpusNgrams(answers, max_order=4, min_count=1)
    prompt = verifier.tokenizer.encode("speculative decoding, speculative decoding")
    base = generate(verifier, prompt, cfg=cfg).output_tokens
    costs = VerifyCosts(relative, "test")
    inner = DFlashDrafter(make_model(stub_cfg()), policy=DraftPolicy(costs=costs))
    inner.bind(verifier)
    trace = record(verifier, inner, prompt, base, corpus=table)
    assert any(p.lookup_ngram == 3 for p in trace.positions) and any(p.corpus for p in trace.positions)
    engine = LookupFirstDrafter(inner, block_size=16, corpus=table, policy=DraftPolicy(costs=costs))
    res = generate(verifier, prompt, drafter=engine, cfg=replace(cfg, block_size=16))
    assert res.output_tokens == base
    r = replay([trace], min_confidence=0.0, cut_by=costs, block_size=16, max_new_tokens=40)
    steps = res.decode_steps
    assert (r.steps, r.tau, r.by_cost) == (
        len(steps),
        pytest.approx(statistics.mean(s.acceptance_length for s in steps)),
        True,
    )


def test_lookup_first_drafter_calibrates_per_request_from_its_commits():
    from specdec.costs import VerifyCosts
    from specdec.drafting.lookup.prompt import PromptLookupDrafter

    verifier = StubVerifier()
    cfg = DecodeConfig(max_new_tokens=40, block_size=16)
    prompt = verifier.tokenizer.encode("speculative decoding, speculative decoding")
    base = generate(verifier, prompt, cfg=replace(cfg, block_size=1)).output_tokens
    engine = LookupFirstDrafter(
        PromptLookupDrafter(), policy=DraftPolicy(costs=VerifyCosts((1.0, 1.2, 1.5, 1.8), "t"))
    )
    first = generate(verifier, prompt, drafter=engine, cfg=cfg)
    learnt = engine.calibration.factor("lookup")
    assert first.output_tokens == base and engine.counts["lookup"] > 0 and learnt != 1.0
    again = generate(verifier, prompt, drafter=engine, cfg=cfg)  # a new request starts from the prior
    assert [s.drafted for s in again.steps] == [s.drafted for s in first.steps]
    assert engine.calibration.factor("lookup") == learnt
    engine.reset()
    engine.extend(torch.empty(len(prompt), 0), prompt)
    assert engine.propose(prompt[-1], 8)  # a lookup draft, pending its verdict
    engine.rollback(0)  # a rollback drops it: the next commit is not that draft's verdict
    engine.extend(torch.empty(1, 0), [prompt[-1]])
    assert engine.calibration.factor("lookup") == 1.0


def test_cost_cut_picks_the_better_of_lookup_and_corpus():
    from specdec.costs import VerifyCosts

    costs = VerifyCosts((1.0, 1.0, 1.0, 1.0, 2.0), "t")  # up to 3 drafts free, a fourth costs a step
    out = [5, 1, 2, 3, 4, 6, 8, 9, 7]
    pos = [
        # a 2-gram lookup (first token 0.53) against a corpus token of share 0.9 (0.85 accepted): corpus
        Position((9,), (0.9,), (7, 7), (1, 2, 3, 9), (0.9, 0.9, 0.9, 0.9), lookup_ngram=2),
        *[Position((0,), (0.1,), ())] * 3,
        # a 3-gram lookup beats a weak corpus chain; cut at 3 drafts where the fourth doubles the verify
        Position((9,), (0.9,), (6, 8, 9, 7), (6,), (0.3,), lookup_ngram=3),
        *[Position((0,), (0.1,), ())] * 3,
    ]
    r = replay([Trace("x", out, pos)], min_confidence=0.0, cut_by=costs, block_size=8)
    assert (r.steps, r.tau) == (2, 4.0)  # 5 -> [1 2 3] + 4 -> [6 8 9] + 7


def test_corpus_policy_order_lookup_then_corpus_then_dflash():
    out = [5, 1, 2, 3, 4, 6, 8, 9]
    no = Position((0,), (0.9,), ())  # nothing from lookup or corpus; DFlash wrong
    pos = [
        Position((9,), (0.9,), (1, 2), (1,), (1.0,)),  # lookup comes first: 1, 2 accepted
        no,
        no,
        Position((9,), (0.9,), (), (4, 6), (0.6, 0.5)),  # corpus: 4, 6 at cut 0.2 (0.6 * 0.5 = 0.3); 4 at 0.4
        no,
        Position((8,), (0.9,), (), (7,), (0.1,)),  # corpus below either cut: DFlash's 8, or nothing
        no,
    ]
    trace = Trace("x", out, pos)

    def walk(**kw):
        r = replay([trace], min_confidence=0.0, block_size=4, **kw)
        return r.steps, r.tau

    assert walk(corpus=0.2, dflash=False) == (3, 7 / 3)  # steps 0 -> 3 -> 6 -> 7
    assert walk(corpus=0.4, dflash=False) == (4, 7 / 4)  # 0 -> 3 -> 5 -> 6 -> 7
    assert walk(corpus=0.4, dflash=True) == (3, 7 / 3)  # 0 -> 3 -> 5 -> 7
    assert walk(dflash=True) == (4, 7 / 4)  # no corpus: lookup, then DFlash: 0 -> 3 -> 4 -> 5 -> 7
    got = first_draft_agreement([trace])
    assert got["corpus"] == 0.5 and got["corpus_coverage"] == 2 / 7


def stub_corpus(path, v):
    """A small corpus folder of the stub verifier's own answers, as `specdec train` writes one."""
    from specdec.train.corpus import Corpus, build_stage

    corpus = Corpus.create(path, v, max_len=120)
    prompts = [(f"p{i}", [{"role": "user", "content": f"write about topic {i}"}]) for i in range(6)]
    corpus.start_stage("s", lambda: prompts, budget=40, chunk_size=3)
    build_stage(corpus, v, "s", encode=lambda m: v.tokenizer.encode(m[0]["content"]), progress=False)
    return path


def test_corpus_on_the_cli(tmp_path, capsys):
    import json

    from specdec.evals.replay import main

    v = StubVerifier()
    stub_corpus(tmp_path / "corpus", v)
    ckpt = DFlashDrafter(make_model(stub_cfg())).save_pretrained(tmp_path / "ckpt")
    base = ["--verifier", "stub", "--drafter", str(ckpt), "--dataset", "mtbench", "--limit", "1",
            "--max-new-tokens", "32", "--grid", "0"]  # fmt: skip
    out = tmp_path / "r.json"
    assert main([*base, "--corpus", str(tmp_path / "corpus"), "--corpus-cut", "0.3", "--out", str(out)]) == 0
    assert "+lookup +corpus P=0.3" in capsys.readouterr().out
    (got,) = json.loads(out.read_text())["drafters"]
    assert [(r["corpus"], r["dflash"]) for r in got["results"] if r["corpus"] is not None] == [
        (0.3, False), (0.3, True),
    ]  # fmt: skip
    assert main([*base, "--corpus", str(ckpt)]) == 2  # not a corpus: refused before the model loads
    assert "is not a corpus" in capsys.readouterr().err
    meta = json.loads((tmp_path / "corpus" / "corpus.json").read_text())
    meta["verifier"]["vocab_size"] += 1
    (tmp_path / "corpus" / "corpus.json").write_text(json.dumps(meta))
    assert main([*base, "--corpus", str(tmp_path / "corpus")]) == 2
    assert "not by the verifier's model" in capsys.readouterr().err


def test_engine_corpus_option(tmp_path, capsys):
    """`--corpus` on the engine's commands: recorded in the result, exact, and refused early where wrong."""
    import json

    from specdec.cli import main

    v = StubVerifier()
    corpus = str(stub_corpus(tmp_path / "corpus", v))
    ckpt = str(DFlashDrafter(make_model(stub_cfg())).save_pretrained(tmp_path / "ckpt"))
    base = ["generate", "--verifier", "stub", "--prompt", "write about topic 2", "--max-new-tokens", "24"]
    assert main([*base, "--drafter", "none", "--out", str(tmp_path / "ar.json")]) == 0
    out = tmp_path / "r.json"
    args = ["--drafter", f"{ckpt}+lookup", "--corpus", corpus, "--corpus-cut", "0.3", "--out", str(out)]
    assert main([*base, *args]) == 0
    got = json.loads(out.read_text())
    assert got["config"]["drafter"]["corpus"] == {"path": corpus, "cut": 0.3}
    assert got["config"]["drafter"]["name"].endswith("+lookup+corpus")
    assert got["config"]["drafter"]["proposals"]["corpus"] > 0
    ar = json.loads((tmp_path / "ar.json").read_text())
    assert got["prompts"][0]["output_tokens"] == ar["prompts"][0]["output_tokens"]
    capsys.readouterr()
    assert main([*base, "--drafter", ckpt, "--corpus", corpus]) == 2  # not a '+lookup' drafter
    assert "give a '+lookup' drafter" in capsys.readouterr().err
    assert main([*base, "--drafter", f"{ckpt}+lookup", "--corpus", ckpt]) == 2
    assert "is not a corpus" in capsys.readouterr().err
    assert main([*base, "--drafter", f"{ckpt}+lookup", "--corpus", corpus, "--corpus-cut", "2"]) == 2
    meta = json.loads((tmp_path / "corpus" / "corpus.json").read_text())
    meta["verifier"]["vocab_size"] += 1
    (tmp_path / "corpus" / "corpus.json").write_text(json.dumps(meta))
    assert main([*base, "--drafter", f"{ckpt}+lookup", "--corpus", corpus]) == 2
    assert "not by the verifier's model" in capsys.readouterr().err


def test_load_drafter_refuses_a_bad_corpus_cut_before_loading(tmp_path):
    from specdec.api import load_drafter

    v = StubVerifier()
    corpus = stub_corpus(tmp_path / "corpus", v)
    with pytest.raises(ValueError, match=r"corpus_cut must be in \[0, 1\], got 2"):  # no drafter there
        load_drafter(str(tmp_path / "nowhere") + "+lookup", verifier=v, corpus=corpus, corpus_cut=2.0)


@pytest.mark.parametrize("lookup", [False, True])
def test_tree_replay_equals_the_engine_on_the_stub(lookup):
    """`replay_tree` walks the trees the engine verifies with `--tree N` (DFlash alone, and +lookup with
    lookup's draft as a branch): same steps, same τ, same mean tree size."""
    from specdec.evals.replay import replay_tree
    from specdec.tree import TreeBudget

    verifier = StubVerifier()
    model = make_model(stub_cfg())
    prompt = verifier.tokenizer.encode("speculative decoding, exactly; speculative decoding, exactly")
    n = 48
    base = generate(verifier, prompt, cfg=DecodeConfig(max_new_tokens=n, block_size=1)).output_tokens
    probe = DFlashDrafter(model)
    probe.bind(verifier)
    trace = record(verifier, probe, prompt, base)
    from specdec.costs import VerifyCosts

    auto = VerifyCosts(tuple(1 + 0.04 * b for b in range(32)), source="test")  # --tree auto's cut
    for nodes, cut in ((2, None), (6, None), (16, None), (32, auto)):
        drafter = DFlashDrafter(model)
        drafter.bind(verifier)
        bs = drafter.block_size
        if lookup:
            drafter = LookupFirstDrafter(drafter, block_size=bs)
        cfg = DecodeConfig(max_new_tokens=n, block_size=bs, tree=TreeBudget(nodes, costs=cut))
        res = generate(verifier, prompt, drafter=drafter, cfg=cfg)
        assert res.output_tokens == base
        steps = res.decode_steps
        r = replay_tree([trace], nodes=nodes, lookup=lookup, block_size=bs, max_new_tokens=n, cut_by=cut)
        assert r.steps == len(steps) and r.tau == pytest.approx(
            statistics.mean(s.acceptance_length for s in steps)
        )
        trees = [s.tree_nodes for s in steps if s.tree_nodes is not None]
        assert r.tree_nodes_mean == pytest.approx(statistics.mean(trees))
    if lookup:
        assert drafter.counts["lookup"] > 0


def test_tree_replay_lookup_first_verifies_lookup_drafts_alone():
    """The `lookup_first` study: where lookup has a draft it is the whole step (no DFlash time), trees
    elsewhere; with branches (`lookup=True`) the DFlash tree runs beside it."""
    from specdec.evals.replay import replay_tree

    out = [1, 2, 3, 4, 5, 6, 7, 8]
    cands = ((9, 3), (9, 4), (9, 5))  # DFlash's candidates, the same at every position
    logp = ((-0.1, -2.0),) * 3
    pos = [Position((9, 9, 9), (0.9,) * 3, (), candidates=cands, candidate_logp=logp) for _ in out[:-1]]
    pos[0] = replace(pos[0], lookup=(2, 3, 4))  # lookup has the answer at the first position only
    trace = Trace("x", out, pos)
    costs = {1: 1.0, 2: 1.0, 8: 1.0}
    first = replay_tree([trace], nodes=8, lookup_first=True, block_size=4, costs=costs, draft_s=1.0)
    both = replay_tree([trace], nodes=8, lookup=True, block_size=4, costs=costs, draft_s=1.0)
    assert first.steps == both.steps and first.tau == both.tau  # the same paths accepted here...
    assert first.est_speedup > both.est_speedup  # ...but the lookup step spent no drafter time
