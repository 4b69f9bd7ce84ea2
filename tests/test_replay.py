"""The policy replay (`specdec.evals.replay`) against the engine: same steps, same τ, for DFlash blocks cut
at several confidences, with and without prompt lookup."""

from __future__ import annotations

import statistics

import pytest
from test_dflash import make_model, stub_cfg

from specdec.dflash import DFlashDrafter
from specdec.engine import DecodeConfig, generate
from specdec.evals.replay import Position, Trace, first_draft_agreement, measure_costs, record, replay
from specdec.ngram import LookupFirstDrafter
from specdec.verifiers.stub import StubVerifier


def engine_tau(verifier, model, prompt, *, p, lookup, n):
    drafter = DFlashDrafter(model, min_confidence=p)
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
    with pytest.raises(ValueError, match="lookup, DFlash or both"):
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
    ("rel", "block", "p"),
    [
        (dict(b1=1, b2=1.02, b4=1.03, b8=1.06, b16=1.15), 16, 0.02),  # GPU-like: whole blocks
        (dict(b1=1, b2=1.16, b4=1.21, b8=1.30, b16=1.56), 16, 0.16),  # this CPU in fp32 (issue 17)
        (dict(b1=1, b2=1.1, b4=1.2, b8=3.6), 4, 0.1),  # rows 5..8 cost 0.6 each: stop at 4
        (dict(b1=1, b2=1.9, b4=3.5), 2, 0.9),  # a second row costs 0.9: one draft, cut at 0.9
    ],
)
def test_auto_block_and_confidence_from_a_cost_table(rel, block, p):
    from specdec.evals.replay import choose_from_costs

    got_block, got_p, why = choose_from_costs(_table(**rel), max_block=16)
    assert (got_block, got_p) == (block, p) and "cost table" in why
    assert choose_from_costs(_table(**rel), max_block=8)[0] == min(block, 8)


def test_auto_options_on_the_cli(tmp_path, capsys):
    import json

    from specdec.cli import main

    ckpt = DFlashDrafter(make_model(stub_cfg())).save_pretrained(tmp_path / "ckpt")
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(_table(b1=1, b2=1.1, b4=1.2, b8=3.6)))
    base = ["generate", "--verifier", "stub", "--drafter", str(ckpt), "--prompt", "hello",
            "--max-new-tokens", "6"]  # fmt: skip
    out = tmp_path / "r.json"
    argv = [
        *base,
        "--block-size",
        "auto",
        "--min-confidence",
        "auto",
        "--costs",
        str(costs),
        "--out",
        str(out),
    ]
    assert main(argv) == 0, capsys.readouterr().err
    cfg = json.loads(out.read_text())["config"]
    assert "block size 4, min confidence 0.1" in capsys.readouterr().err
    assert cfg["block_size"] == 4 and cfg["drafter"]["min_confidence"] == 0.1
    for extra, msg in [
        (["--block-size", "auto"], "give --costs FILE"),
        (["--costs", str(costs)], "read only with --block-size auto"),
        (["--block-size", "auto", "--costs", str(tmp_path)], "cannot read a JSON cost table"),
        (["--min-confidence", "auto", "--costs", str(ckpt / "config.json")], "no 'relative' costs"),
    ]:
        assert main([*base, *extra]) == 2
        assert msg in capsys.readouterr().err
