"""Logits processors inside verification (`specdec.processors`): the definitions against a slow per-row
reference and against transformers' and mlx_lm's own processors; speculative == autoregressive with the
same processors (chains of every acceptance, trees, the HF and MLX verifiers, T > 0 by chi-square); a
processor that ignores a row's drafts fails the same tests; the server honours the fields."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
import torch
from drafters import ScriptedDrafter, TreeDrafter

from specdec.engine import DecodeConfig, generate
from specdec.processors import LogitsParams, Processor
from specdec.sampling import SamplingParams
from specdec.tree import TreeBudget
from specdec.verifiers.stub import StubConfig, StubVerifier

PROMPT = [5, 9, 5, 17, 33, 9, 5]
#: strong enough to change a small model's greedy text (checked: the unprocessed text differs)
STRONG = LogitsParams(logit_bias={3: 2.5, 7: -100}, repetition_penalty=1.8, presence_penalty=0.7,
                      frequency_penalty=0.4)  # fmt: skip
WINDOWED = LogitsParams(
    repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.9, penalty_context=8
)


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], paths, p: LogitsParams):
    """The definitions, row by row, token by token (module docstring of specdec.processors)."""
    out = logits.to(torch.float32, copy=True)
    for r, path in enumerate(paths):
        hist, gen = [*prompt, *output, *path], [*output, *path]
        rep_w = hist if p.penalty_context is None else hist[-p.penalty_context :]
        pf_w = gen if p.penalty_context is None else hist[-p.penalty_context :]
        for t, b in p.logit_bias:
            out[r, t] = out[r, t] + b
        for t in set(rep_w):
            if p.repetition_penalty != 1:
                x = out[r, t]
                out[r, t] = x * p.repetition_penalty if x < 0 else x / p.repetition_penalty
        for t, k in Counter(pf_w).items():  # the penalties as fp32 numbers, times the count in fp32
            if p.presence_penalty:
                out[r, t] = out[r, t] - torch.tensor(p.presence_penalty) * 1.0
            if p.frequency_penalty:
                out[r, t] = out[r, t] - torch.tensor(p.frequency_penalty) * float(k)
    return out


@pytest.mark.parametrize("params", [STRONG, WINDOWED, LogitsParams(penalty_context=1, presence_penalty=1)])
def test_rows_follow_the_definitions(params: LogitsParams) -> None:
    rng = random.Random(0)
    for _ in range(20):
        V = 40
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(V) for _ in range(rng.randrange(0, 9))]
        paths = [[rng.randrange(V) for _ in range(i)] for i in range(rng.randrange(1, 7))]
        logits = torch.randn(len(paths), V, generator=torch.Generator().manual_seed(rng.randrange(99))) * 4
        proc = Processor(params, prompt)
        proc.commit(output)
        got = proc(logits.to(torch.bfloat16), paths)
        want = reference(logits.to(torch.bfloat16), prompt, output, paths, params)
        assert torch.equal(got, want)


def test_the_params_are_checked() -> None:
    for kw, says in [
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a finite number"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be in \(0, 100\]"),
        ({"penalty_context": 0}, "penalty_context must be an integer >= 1"),
        ({"logit_bias": {"a": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {1: 200}}, r"logit_bias\[1\] must be in \[-100, 100\]"),
    ]:
        with pytest.raises(ValueError, match=says):
            LogitsParams(**kw)
    assert LogitsParams(logit_bias={"12": -5}).logit_bias == ((12, -5.0),)
    assert not LogitsParams().active and LogitsParams(presence_penalty=-1).active
    with pytest.raises(ValueError, match=r"logit_bias token ids \[70\] outside the vocabulary"):
        LogitsParams(logit_bias={70: 1}).check(64)


@pytest.mark.hf
def test_equal_to_transformers_own_processors() -> None:
    """transformers' repetition penalty and sequence bias (single tokens) on the same scores: equal."""
    pytest.importorskip("transformers")
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    prompt, output = [1, 4, 4, 9, 2], [7, 4]
    scores = torch.randn(1, 30, generator=torch.Generator().manual_seed(3)) * 3
    ids = torch.tensor([[*prompt, *output]])
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(
        ids, SequenceBiasLogitsProcessor([[[5], 4.0]])(ids, scores)
    )
    ours = Processor(LogitsParams(logit_bias={5: 4.0}, repetition_penalty=1.7), prompt)
    ours.commit(output)
    assert torch.equal(ours(scores, [()]), theirs)


@pytest.mark.mlx
def test_equal_to_mlx_lms_own_processors() -> None:
    """mlx_lm's processors (windows of the last N tokens of prompt and output) on the same logits."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.sample_utils import make_logits_processors

    prompt, output = [1, 4, 4, 9, 2, 11, 4], [7, 4, 3]
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(4)) * 3
    # mlx_lm's windows: the last 20 tokens, as penalty_context=20
    procs = make_logits_processors(logit_bias={5: 4.0}, repetition_penalty=1.7, repetition_context_size=6,
                                   presence_penalty=0.6, presence_context_size=6, frequency_penalty=0.3,
                                   frequency_context_size=6)  # fmt: skip
    x, hist = mx.array(logits.numpy()), mx.array([*prompt, *output])
    for f in procs:
        x = f(hist, x)
    ours = Processor(LogitsParams(logit_bias={5: 4.0}, repetition_penalty=1.7, presence_penalty=0.6,
                                  frequency_penalty=0.3, penalty_context=6), prompt)  # fmt: skip
    ours.commit(output)
    import numpy as np

    torch.testing.assert_close(ours(logits, [()]), torch.from_numpy(np.array(x)), rtol=0, atol=1e-6)


# ---- speculative == autoregressive under the same processors ---------------------------------------------


@pytest.fixture(scope="module")
def stub() -> StubVerifier:
    return StubVerifier(StubConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
                                   intermediate_size=64, max_context=256, logit_scale=3.0))  # fmt: skip


def _run(v, drafter, params, n=40, block=6, **kw):
    cfg = DecodeConfig(max_new_tokens=n, block_size=block if drafter else 1, stop_token_ids=frozenset(),
                       logits=params, **kw)  # fmt: skip
    return generate(v, PROMPT, drafter=drafter, cfg=cfg)


def _drafters(v, ar: list[int]) -> dict:
    ref = PROMPT + ar
    return {
        "all": ScriptedDrafter(ref, vocab=v.vocab_size, block_size=6),
        "none": ScriptedDrafter(ref, vocab=v.vocab_size, block_size=6, wrong_at=range(len(ref) + 64)),
        "part": ScriptedDrafter(ref, vocab=v.vocab_size, block_size=6, wrong_at=(len(PROMPT) + 3, 20, 31)),
    }


@pytest.mark.parametrize("params", [STRONG, WINDOWED])
def test_chains_equal_ar_under_processors(stub: StubVerifier, params: LogitsParams) -> None:
    ar = _run(stub, None, params).output_tokens
    assert ar != _run(stub, None, None).output_tokens  # the processors change the text
    for name, d in _drafters(stub, ar).items():
        steps = _run(stub, d, params)
        assert steps.output_tokens == ar, name
        drafted = sum(s.drafted for s in steps.decode_steps)
        accepted = sum(s.accepted for s in steps.decode_steps)
        assert {"all": accepted == drafted > 0, "none": accepted == 0 < drafted,
                "part": 0 < accepted < drafted}[name], (name, accepted, drafted)  # fmt: skip


def test_a_processor_blind_to_the_drafts_fails_the_same_test(
    stub: StubVerifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row processed as if it were the first (the drafts before it not in its history): the
    committed text parts from autoregressive decoding's."""
    ar = _run(stub, None, STRONG).output_tokens
    real = Processor.__call__
    monkeypatch.setattr(
        Processor, "__call__", lambda self, logits, paths: real(self, logits, [()] * len(paths))
    )
    assert _run(stub, _drafters(stub, ar)["all"], STRONG).output_tokens != ar


def test_trees_equal_ar_under_processors(stub: StubVerifier) -> None:
    ar = _run(stub, None, STRONG).output_tokens
    d = TreeDrafter(PROMPT + ar, vocab=stub.vocab_size, block_size=6, wrong_at=(len(PROMPT) + 2, 25))
    res = _run(stub, d, STRONG, tree=TreeBudget(12))
    assert res.output_tokens == ar
    assert any(s.tree_nodes for s in res.decode_steps)


def test_streams_and_sessions_take_the_processors(stub: StubVerifier) -> None:
    from specdec.stream import StreamingEngine

    ar = _run(stub, None, STRONG, n=24).output_tokens
    eng = StreamingEngine(stub, _drafters(stub, ar)["part"])
    got = eng.complete(PROMPT, max_tokens=24, stop_token_ids=frozenset(), logits=STRONG)
    assert got.output_tokens == ar


@pytest.mark.slow
def test_sampled_with_processors_keeps_the_processed_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chi-square of the first three tokens against plain sampling with the same processors, enumerated
    (tests/test_sampling.py's harness), drafts from its model drafter verified by `rejection`; with the
    drafts left out of each row's history (a broken processor) the same test fails."""
    import test_sampling as ts

    params = LogitsParams(logit_bias={2: 1.5}, repetition_penalty=1.6, frequency_penalty=0.5)
    v = StubVerifier(StubConfig(vocab_size=ts.V, hidden_size=16, num_layers=2, num_heads=2,
                                intermediate_size=32, max_context=64, logit_scale=1.5))  # fmt: skip
    sp = SamplingParams(temperature=1.0, rule="rejection", proposal="sample")

    def exact() -> dict:
        def dist(prefix):
            v.reset()
            proc = Processor(params, ts.PROMPT)
            proc.commit(prefix)
            from specdec.sampling import warp

            return warp(proc(v.forward([*ts.PROMPT, *prefix], last_only=True), [()]), sp)[0].double()

        p1, out = dist([]), {}
        for a in range(ts.V):
            p2 = dist([a])
            for b in range(ts.V):
                p3 = dist([a, b])
                for c in range(ts.V):
                    out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
        return out

    def sampled(n: int) -> Counter:
        counts: Counter = Counter()
        d = ts.ModelDrafter()
        for seed in range(n):
            cfg = DecodeConfig(max_new_tokens=3, block_size=4, stop_token_ids=frozenset(), logits=params,
                               sampling=SamplingParams(**{**sp.__dict__, "seed": seed}))  # fmt: skip
            counts[tuple(generate(v, ts.PROMPT, drafter=d, cfg=cfg).output_tokens)] += 1
        return counts

    want = exact()
    stat, df = ts.chi2_stat(sampled(ts.N_SAMPLES), want, ts.N_SAMPLES)
    assert stat < ts.chi2_threshold(df, ts.ALPHA), (stat, df)
    real = Processor.__call__
    monkeypatch.setattr(
        Processor, "__call__", lambda self, logits, paths: real(self, logits, [()] * len(paths))
    )
    stat, df = ts.chi2_stat(sampled(ts.N_BROKEN), want, ts.N_BROKEN)
    assert stat > ts.chi2_threshold(df, ts.ALPHA), (stat, df)


# ---- the real verifiers, against their runtimes' own generation with the same processors -----------------


@pytest.mark.hf
def test_hf_verifier_equals_transformers_generate_with_the_same_processors(tmp_path) -> None:
    """fp32, a tiny Llama: our AR and our speculative decoding (lookup, scripted) with a repetition penalty
    and a bias equal transformers' `generate(repetition_penalty=..., sequence_bias=...)`."""
    pytest.importorskip("transformers")
    from tinymodels import tiny_llama

    from specdec.api import load_drafter
    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(tiny_llama(tmp_path / "llama"))
    eos = sorted(v.eos_token_ids)
    # min_new_tokens bans EOS in theirs (-inf); ours bans it by a bias of -100 (never picked either way)
    params = LogitsParams(logit_bias={3: 2.0, **dict.fromkeys(eos, -100.0)}, repetition_penalty=1.6)
    ids = torch.tensor([PROMPT])
    theirs = v.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30,
                              min_new_tokens=30, pad_token_id=0, repetition_penalty=1.6,
                              sequence_bias=[[[3], 2.0]])[0, len(PROMPT):].tolist()  # fmt: skip
    ar = _run(v, None, params, n=30).output_tokens
    assert ar == theirs
    assert ar != _run(v, None, None, n=30).output_tokens
    for d in [load_drafter("prompt-lookup", verifier=v, block_size=6), *_drafters(v, ar).values()]:
        assert _run(v, d, params, n=30).output_tokens == ar, d.name


@pytest.mark.mlx
def test_mlx_verifier_equals_mlx_lms_generate_with_the_same_processors(tmp_path) -> None:
    """The same tiny Llama in MLX: our AR and speculative decoding with mlx_lm's windows equal mlx_lm's
    `generate_step` with its own `make_logits_processors`."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors
    from tinymodels import tiny_llama

    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(tiny_llama(tmp_path / "llama"))
    params = LogitsParams(logit_bias={3: 2.0}, repetition_penalty=1.6, presence_penalty=0.5,
                          frequency_penalty=0.25, penalty_context=20)  # fmt: skip
    # mlx_lm's windows: the last 20 tokens, as penalty_context=20
    procs = make_logits_processors(
        logit_bias={3: 2.0}, repetition_penalty=1.6, presence_penalty=0.5, frequency_penalty=0.25
    )  # fmt: skip
    gen = generate_step(mx.array(PROMPT), v.model, max_tokens=30, sampler=lambda lp: mx.argmax(lp, axis=-1),
                        logits_processors=procs)  # fmt: skip
    theirs = [int(t) for t, _ in gen]
    ar = _run(v, None, params, n=30).output_tokens
    assert ar == theirs
    assert ar != _run(v, None, None, n=30).output_tokens
    for name, d in _drafters(v, ar).items():
        assert _run(v, d, params, n=30).output_tokens == ar, name


def test_the_command_line_checks_them_before_loading(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import specdec.api as api
    from specdec.cli import main

    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    for flags, says in [
        (["--logit-bias", '{"99999": 1}'], r"logit_bias token ids \[99999\] outside the vocabulary"),
        (["--logit-bias", "[1]"], "--logit-bias must be a JSON object"),
        (["--logit-bias", "{"], "--logit-bias is not JSON"),
        (["--presence-penalty", "3"], "--presence-penalty"),
    ]:
        assert main(["generate", "--verifier", "stub", "--prompt", "abc", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert re.search(says, err) and err.count("\n") <= 2, (flags, err)
