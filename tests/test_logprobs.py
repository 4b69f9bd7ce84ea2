"""Log-probabilities of the committed tokens (`DecodeConfig.logprobs`): against a full recompute of the
processed distribution, speculative == autoregressive entry for entry (chains of every acceptance, trees,
under processors and a grammar), the HF and MLX verifiers against their runtimes' own scores; the server's
OpenAI fields, streamed and not. Rows taken off by one fail the same test."""

from __future__ import annotations

import pytest
import torch
from drafters import ScriptedDrafter, TreeDrafter

from specdec.engine import DecodeConfig, Logprobs, generate
from specdec.grammar import GrammarSpec
from specdec.processors import LogitsParams, Processor
from specdec.tree import TreeBudget
from specdec.verifiers.stub import StubConfig, StubVerifier

PROMPT = [5, 9, 5, 17, 33, 9, 5]
PARAMS = LogitsParams(logit_bias={3: 2.5}, repetition_penalty=1.5, presence_penalty=0.4)


@pytest.fixture(scope="module")
def stub() -> StubVerifier:
    """Attention through the batch-invariant kernel: whether the whole verify is invariant here is measured
    (`batch_invariant`), and decides whether speculation's entries must equal AR's bit for bit."""
    cfg = StubConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                     max_context=256, logit_scale=3.0)  # fmt: skip
    return StubVerifier(cfg, invariant=True)


def _assert_same(run, ar, v, name="") -> None:
    """Speculative entries against AR's: bit for bit where `v` measured its verify batch-invariant, else the
    same tokens and log-probabilities within 1e-5 (a verify of several rows rounds unlike one row)."""
    assert run.output_tokens == ar.output_tokens, name
    a, b = _entries(run), _entries(ar)
    if v.batch_invariant:
        assert a == b, name
        return
    from specdec.measure import verify_equals_steps

    assert not verify_equals_steps(v), "invariant, yet not claimed"
    for x, y in zip(a, b, strict=True):
        assert x.token == y.token and x.logprob == pytest.approx(y.logprob, abs=1e-5), name


def _run(v, drafter, *, n=30, block=6, top=3, params=None, prompt=PROMPT, **kw):
    cfg = DecodeConfig(max_new_tokens=n, block_size=block if drafter else 1, stop_token_ids=frozenset(),
                       logits=params, logprobs=top, **kw)  # fmt: skip
    return generate(v, prompt, drafter=drafter, cfg=cfg)


def _entries(run):
    return [e for s in run.steps for e in s.logprobs]


def _drafters(v, ar: list[int], block=6) -> dict:
    ref = PROMPT + ar
    return {
        "all": ScriptedDrafter(ref, vocab=v.vocab_size, block_size=block),
        "none": ScriptedDrafter(ref, vocab=v.vocab_size, block_size=block, wrong_at=range(len(ref) + 64)),
        "part": ScriptedDrafter(
            ref, vocab=v.vocab_size, block_size=block, wrong_at=(len(PROMPT) + 3, 20, 31)
        ),
    }


@pytest.mark.parametrize("params", [None, PARAMS])
def test_entries_equal_a_full_recompute(stub: StubVerifier, params) -> None:
    """Each entry: the log-softmax, at that position, of the whole sequence's logits recomputed from
    scratch and processed with the history before it; the top k in order."""
    run = _run(stub, None, params=params)
    tokens = run.output_tokens
    for i, e in enumerate(_entries(run)):
        stub.reset()
        logits = stub.forward([*PROMPT, *tokens[:i]], last_only=True)  # [1, V]
        if params is not None:
            proc = Processor(params, PROMPT)
            proc.commit(tokens[:i])
            logits = proc(logits, [()])
        want = torch.log_softmax(logits.float(), dim=-1)[0]
        assert e.token == tokens[i] and e.logprob == pytest.approx(float(want[e.token]), abs=1e-5)
        vals, ids = want.topk(3)
        assert [t for t, _ in e.top] == ids.tolist()
        assert [p for _, p in e.top] == pytest.approx(vals.tolist(), abs=1e-5)
    assert len(_entries(run)) == len(tokens)


@pytest.mark.parametrize("params", [None, PARAMS])
def test_speculative_entries_equal_autoregressive(stub: StubVerifier, params) -> None:
    ar = _run(stub, None, params=params)
    for name, d in _drafters(stub, ar.output_tokens).items():
        _assert_same(_run(stub, d, params=params), ar, stub, name)


def test_rows_off_by_one_fail_the_same_test(stub: StubVerifier, monkeypatch: pytest.MonkeyPatch) -> None:
    ar = _run(stub, None)
    real = Logprobs.take
    monkeypatch.setattr(Logprobs, "take", lambda self, rows, tokens: real(self, [0] * len(tokens), tokens))
    got = _entries(_run(stub, _drafters(stub, ar.output_tokens)["all"]))
    assert [round(e.logprob, 3) for e in got] != [round(e.logprob, 3) for e in _entries(ar)]


def test_trees_and_grammar_entries_equal_autoregressive(stub: StubVerifier) -> None:
    ar = _run(stub, None)
    ref = PROMPT + ar.output_tokens
    for kw in [{}, {"wrong_at": (len(PROMPT) + 4, 22)}]:
        d = TreeDrafter(ref, vocab=stub.vocab_size, block_size=5, **kw)
        _assert_same(_run(stub, d, block=5, tree=TreeBudget(nodes=10)), ar, stub, str(kw))
    big = StubVerifier(invariant=True)  # a grammar needs the byte tokenizer
    prompt = big.tokenizer.encode("JSON:")
    grammar = LogitsParams(grammar=GrammarSpec("regex", "[a-e]{3}(,[a-e]{3}){3}"))
    g_ar = _run(big, None, params=grammar, prompt=prompt, top=5)
    g = _run(big, ScriptedDrafter(prompt + g_ar.output_tokens, vocab=big.vocab_size, block_size=6),
             params=grammar, prompt=prompt, top=5)  # fmt: skip
    _assert_same(g, g_ar, big)
    for e in _entries(g_ar)[:-1]:  # the grammar's mask: the top tokens are letters a-e or the comma
        assert all(chr(t) in "abcde," for t, p in e.top if p > float("-inf")), e


def test_the_number_is_checked(stub: StubVerifier) -> None:
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(ValueError, match=r"logprobs .* must be 0\.\.20"):
            _run(stub, None, top=bad)


# ---- the real verifiers, against their runtimes' own scores -----------------------------------------------


@pytest.mark.hf
def test_hf_verifier_equals_transformers_scores(tmp_path) -> None:
    """fp32, a tiny Llama: our AR entries equal the log-softmax of transformers' `generate(output_logits=
    True)`; speculative entries equal AR's (to 1e-5: a verify of several rows rounds unlike one row here)."""
    pytest.importorskip("transformers")
    from tinymodels import tiny_llama

    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(tiny_llama(tmp_path / "llama"))
    ids = torch.tensor([PROMPT])
    out = v.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                           min_new_tokens=20, pad_token_id=0, output_logits=True,
                           return_dict_in_generate=True)  # fmt: skip
    theirs = [torch.log_softmax(x[0].float(), -1) for x in out.logits]
    ar = _run(v, None, n=20)
    assert ar.output_tokens == out.sequences[0, len(PROMPT) :].tolist()
    for e, row in zip(_entries(ar), theirs):
        assert e.logprob == float(row[e.token])
    for name, d in _drafters(v, ar.output_tokens).items():
        run = _run(v, d, n=20)
        assert run.output_tokens == ar.output_tokens, name
        for a, b in zip(_entries(run), _entries(ar)):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5), name


@pytest.mark.mlx
def test_mlx_verifier_equals_mlx_lms_logprobs(tmp_path) -> None:
    """The same tiny Llama in MLX: our AR entries equal the logprobs mlx_lm's `generate_step` yields."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.generate import generate_step
    from tinymodels import tiny_llama

    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(tiny_llama(tmp_path / "llama"))
    gen = generate_step(mx.array(PROMPT), v.model, max_tokens=20, sampler=lambda lp: mx.argmax(lp, axis=-1))
    theirs = [(int(t), lp) for t, lp in gen]
    ar = _run(v, None, n=20)
    assert ar.output_tokens == [t for t, _ in theirs]
    for e, (t, lp) in zip(_entries(ar), theirs):
        assert e.logprob == pytest.approx(lp[t].item(), abs=1e-5)
    for name, d in _drafters(v, ar.output_tokens).items():
        run = _run(v, d, n=20)
        for a, b in zip(_entries(run), _entries(ar)):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5), name
