"""A small causal LM of the verifier's tokenizer as the drafter (`--drafter model:...`,
`drafting.draft_model.drafter.ModelDrafter`): exact output with any draft model on every runtime, every draft
accepted when the draft model is the verifier's own model (so its cache always holds exactly the
committed context plus its drafts), after rollbacks, stop cuts and multi-turn reuse; hybrid and
sliding-window draft models; tokenizer mismatch refused before the draft model's weights load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from drafters import assert_turns_equal_fresh_runs, greedy_reference

from specdec.api import load_drafter
from specdec.drafting.draft_model.drafter import ModelDrafter, tokenizer_mismatch
from specdec.drafting.policy import DraftPolicy
from specdec.engine import DecodeConfig, generate
from specdec.protocols import RollbackError
from specdec.sampling import SamplingParams
from specdec.stream import StreamingEngine
from specdec.verifiers.stub import StubConfig, StubVerifier

PROMPT = [(7 * i) % 250 + 5 for i in range(40)]


def run(v, drafter=None, *, n: int = 32, block: int = 5, prompt=PROMPT, sampling=None):
    cfg = DecodeConfig(
        max_new_tokens=n, block_size=block if drafter else 1, stop_token_ids=frozenset(), sampling=sampling
    )
    return generate(v, prompt, drafter=drafter, cfg=cfg)


def taus(res) -> list[int]:
    return [s.acceptance_length for s in res.decode_steps]


# ---- the stub: every path without mlx or transformers ---------------------------------------------------


def test_stub_draft_models_exact_and_self_draft_accepts_all():
    v = StubVerifier()
    ar = run(v).output_tokens
    assert ar == greedy_reference(v, PROMPT, 32)
    other = ModelDrafter(StubVerifier(StubConfig(seed=1)), block_size=5)
    other.bind(v)
    assert run(v, other).output_tokens == ar
    assert other.restarts == 0  # every rejected draft rolled back exactly
    match = SamplingParams(temperature=0.9, seed=4, rule="match", proposal="sample")
    assert run(v, other, sampling=match).output_tokens == run(v, sampling=match).output_tokens
    same = ModelDrafter(StubVerifier(), block_size=5)
    same.bind(v)
    res = run(v, same)
    assert res.output_tokens == ar
    # every draft accepted (the last step may be cut by max_new_tokens): the draft cache is exact
    assert all(t == 5 for t in taus(res)[:-1])
    # again, from a drafter that has drafted before (reset clears its cache)
    assert run(v, same).output_tokens == ar and all(t == 5 for t in taus(run(v, same))[:-1])


def test_stub_sampled_walk_q_is_the_draft_distribution():
    """T > 0: with the draft model equal to the verifier and drafts sampled (`--proposal sample`), q == p
    at every position, so the rejection rule accepts every draft; the match rule keeps AR's tokens."""
    v = StubVerifier()
    same = ModelDrafter(StubVerifier(), block_size=5)
    same.bind(v)
    sp = SamplingParams(temperature=0.8, seed=3, rule="rejection", proposal="sample")
    res = run(v, same, sampling=sp)
    assert all(t == 5 for t in taus(res)[:-1])
    match = SamplingParams(temperature=0.8, seed=3, rule="match", proposal="sample")
    other = ModelDrafter(StubVerifier(StubConfig(seed=1)), block_size=5)
    other.bind(v)
    assert run(v, other, sampling=match).output_tokens == run(v, sampling=match).output_tokens


def test_stub_confidence_cut_and_lookup():
    v = StubVerifier()
    ar = run(v).output_tokens
    cut = ModelDrafter(StubVerifier(StubConfig(seed=1)), block_size=5, policy=DraftPolicy(min_confidence=0.5))
    cut.bind(v)
    res = run(v, cut)
    assert res.output_tokens == ar and max(s.drafted for s in res.decode_steps) <= 4
    from specdec.drafting.mix import LookupFirstDrafter

    mixed = LookupFirstDrafter(ModelDrafter(StubVerifier(StubConfig(seed=1))), block_size=8)
    mixed.bind(v)
    res = run(v, mixed, block=8, prompt=PROMPT * 2)
    assert res.output_tokens == run(v, prompt=PROMPT * 2).output_tokens
    assert mixed.counts["lookup"] > 0 and mixed.counts["drafter"] > 0


def test_stub_multi_turn_reuse_and_stop_cut():
    v = StubVerifier()
    engine = StreamingEngine(v, ModelDrafter(StubVerifier(), block_size=5))
    r1 = engine.complete(PROMPT, max_tokens=20, stop_token_ids=frozenset())
    ids2 = [*PROMPT, *r1.output_tokens, 9, 10, 11]
    r2 = engine.complete(ids2, max_tokens=20, stop_token_ids=frozenset())
    assert r2.reused_tokens > 0 and r2.output_tokens == run(v, prompt=ids2, n=20).output_tokens
    edited = [*PROMPT[:10], 42, 43]  # a rollback deep into what the draft model holds
    r3 = engine.complete(edited, max_tokens=20, stop_token_ids=frozenset())
    assert r3.output_tokens == run(v, prompt=edited, n=20).output_tokens
    stop = v.tokenizer.decode(r3.output_tokens[6:8])
    r4 = engine.complete(edited, max_tokens=20, stop=[stop], stop_token_ids=frozenset())
    assert r4.finish_reason == "stop" and r4.output_tokens == r3.output_tokens[: len(r4.output_tokens)]
    r5 = engine.complete(ids2, max_tokens=20, stop_token_ids=frozenset())
    assert r5.output_tokens == r2.output_tokens


def test_stub_refusals():
    with pytest.raises(ValueError, match="block size must be >= 2"):
        ModelDrafter(StubVerifier(), block_size=1)
    # more rows than the verifier (padding: Qwen sizes differ by model): never proposes past its vocabulary
    v = StubVerifier()
    wide = ModelDrafter(StubVerifier(StubConfig(vocab_size=300, seed=2)))
    wide.bind(v)
    assert run(v, wide).output_tokens == run(v).output_tokens
    why = tokenizer_mismatch(None, StubVerifier().tokenizer, draft_name="a", target_name="b")
    assert why is not None and "a has no tokenizer" in why
    for bad in ("model:", "model:/no/such/folder"):
        with pytest.raises(ValueError, match=r"^drafter 'model:"):
            load_drafter(bad, verifier=StubVerifier())


# ---- real runtimes: tiny random models of the real architectures -------------------------------------------

transformers = pytest.importorskip("transformers")
import parity  # noqa: E402
import tinymodels  # noqa: E402

from specdec.verifiers.hf import HFVerifier  # noqa: E402

try:
    import mlx_lm  # noqa: F401

    from specdec.verifiers.mlx import MLXVerifier

    RUNTIMES = ("hf", "mlx")
except ImportError:  # pragma: no cover - mlx is part of the test extras
    RUNTIMES = ("hf",)

MAKERS = {
    "llama": tinymodels.tiny_llama,
    "gemma3": tinymodels.tiny_gemma3,  # sliding window 16: the draft cache rolls back past it
    "qwen3_5": tinymodels.tiny_qwen3_5,  # Gated DeltaNet: recurrent draft state over several calls
    "gpt_oss": tinymodels.tiny_gpt_oss,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[tuple[str, int], Path]:
    root = tmp_path_factory.mktemp("draft_models")
    out = {}
    for arch, make in MAKERS.items():
        for seed in (0, 1):
            out[arch, seed] = tinymodels.tiny_tokenizer(make(root / f"{arch}{seed}", seed=seed))
    return out


def _load(rt: str, path: Path):
    return HFVerifier(path) if rt == "hf" else MLXVerifier(path)


@pytest.mark.hf
@pytest.mark.mlx
@pytest.mark.parametrize("rt", RUNTIMES)
@pytest.mark.parametrize("arch", list(MAKERS))
def test_draft_models_on_real_runtimes(folders, rt, arch):
    """Per architecture and runtime: a random draft model of the same tokenizer gives AR's tokens; the
    verifier's own model as the draft accepts every draft (greedy, and sampled under rejection); the
    drafter loads by spec through the API; a multi-turn session equals fresh runs."""
    v = _load(rt, folders[arch, 0])
    ar = run(v).output_tokens
    # the reference: the runtime's own greedy generation (fp32, 32 tokens, no stop token)
    own = parity.runtime_generate(v.model, PROMPT, 32) if rt == "hf" else parity.mlx_lm_greedy(v, PROMPT, 32)
    assert ar == own
    runtime = "mlx" if rt == "mlx" else "torch"
    other = load_drafter(f"model:{folders[arch, 1]}", verifier=v, block_size=5, runtime=runtime)
    assert isinstance(other, ModelDrafter) and other.draft.runtime == rt
    assert run(v, other).output_tokens == ar
    assert other.restarts == 0  # every rejected draft rolled back exactly
    match = SamplingParams(temperature=0.9, seed=4, rule="match", proposal="sample")
    assert run(v, other, sampling=match).output_tokens == run(v, sampling=match).output_tokens
    same = load_drafter(f"model:{folders[arch, 0]}", verifier=v, block_size=5, runtime=runtime)
    res = run(v, same)
    assert res.output_tokens == ar and all(t == 5 for t in taus(res)[:-1]), taus(res)
    if arch == "qwen3_5":  # what the draft cache kept to undo drafts is let go once the verifier settled them
        d = same.draft
        if rt == "hf":
            assert all(la.recurrent_states_history[0] == [] for la in d._linear)
        else:
            assert all(not r.calls for r in d._recurrent.values())
    sp = SamplingParams(temperature=0.7, seed=5, rule="rejection", proposal="sample")
    res = run(v, same, sampling=sp)
    assert all(t == 5 for t in taus(res)[:-1]), taus(res)
    # multi-turn: a continued history, then an edited one (a rollback the draft cache may not reach)
    assert_turns_equal_fresh_runs(v, same, PROMPT, lambda ids: run(v, prompt=ids, n=12).output_tokens)
    desc = same.describe()["draft_model"]
    assert desc["runtime"] == rt and desc["dtype"] == "float32"
    # its cache rolled back exactly every time except for the edited history (a rollback past the prefill)
    assert desc["restarts"] <= 1, desc


@pytest.mark.hf
@pytest.mark.mlx
@pytest.mark.parametrize("rt", RUNTIMES)
def test_recurrent_rollback_over_several_calls(folders, rt):
    """What a draft model does: several one-token calls, then one rollback reaching back over them. The
    Gated DeltaNet state after it equals a fresh model's over the kept tokens."""
    v, fresh = _load(rt, folders["qwen3_5", 0]), _load(rt, folders["qwen3_5", 0])
    v.prefill(PROMPT)
    for t in (11, 12, 13, 14):
        v.verify([t])
    v.rollback(3)
    after = v.verify([20, 21])
    fresh.prefill(PROMPT)
    assert after == fresh.verify([11, 20, 21])[1:]
    with pytest.raises(RollbackError):
        v.rollback(0)
        v.verify([5])
        v.rollback(2)  # reaches past the last rollback: refused, never a wrong state


@pytest.mark.hf
def test_tokenizer_mismatch_refused_before_weights_load(folders, tmp_path):
    """Same vocabulary size, two tokens swapped: refused in one line naming them, before the weights load
    (the weights here are garbage, and the error is still the tokenizer's)."""
    v = HFVerifier(folders["llama", 0])
    bad = tmp_path / "swapped"
    shutil.copytree(folders["llama", 1], bad)
    tj = json.loads((bad / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (bad / "tokenizer.json").write_text(json.dumps(tj))
    (bad / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ValueError, match=r"differ in 2 tokens \(e\.g\. \['a', 'b'\]\)") as e:
        load_drafter(f"model:{bad}", verifier=v, block_size=5)
    assert "\n" not in str(e.value)
    assert tokenizer_mismatch(v.tokenizer, v.tokenizer, draft_name="x", target_name="y") is None


@pytest.mark.hf
def test_cli_runs_a_draft_model(folders, tmp_path, capsys):
    from specdec.cli import main

    out = tmp_path / "r.json"
    rc = main([
        "generate", "--verifier", "hf", "--model", str(folders["llama", 0]), "--drafter",
        f"model:{folders['llama', 0]}", "--block-size", "4", "--prompt", "hello", "--max-new-tokens", "12",
        "--out", str(out), "--dtype", "float32",
    ])  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    d = res["config"]["drafter"]
    assert d["name"] == f"model:{folders['llama', 0]}" and d["draft_model"]["runtime"] == "hf"
    assert res["summary"]["acceptance_length_mean"] > 3
    capsys.readouterr()
    rc = main(
        [
            "generate",
            "--verifier",
            "hf",
            "--model",
            str(folders["llama", 0]),
            "--drafter",
            "model:no",
            "--prompt",
            "x",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and err[0].startswith("error: drafter 'model:no'"), err


@pytest.mark.hf
@pytest.mark.mlx
@pytest.mark.parametrize("rt", RUNTIMES)
def test_runtime_speculative_peer(folders, rt):
    """With a draft model, `specdec eval` runs the runtime's own speculative decoding with the same draft
    model and draft length as a peer (mlx_lm's `draft_model`, transformers' assisted generation): it gives
    our AR output, and with the draft model equal to the verifier's every draft is accepted there too."""
    from specdec.evals.run import peer_runners

    v = _load(rt, folders["llama", 0])
    runtime = "mlx" if rt == "mlx" else "torch"
    same = load_drafter(f"model:{folders['llama', 0]}", verifier=v, block_size=5, runtime=runtime)
    cfg = DecodeConfig(max_new_tokens=16, block_size=5)  # the model's EOS (the peers need one)
    runners, notes = peer_runners(v, cfg, same)
    name = "mlx_lm-speculative" if rt == "mlx" else "hf-assisted"
    assert name in runners and "4" in notes[name]
    rec = runners[name](PROMPT)
    ar = generate(v, PROMPT, cfg=DecodeConfig(max_new_tokens=16, block_size=1)).output_tokens
    assert rec["output_tokens"] == ar and len(ar) == 16
    if rt == "mlx":  # steps counted from mlx_lm's `from_draft`: every draft taken, 16 tokens in 4 steps
        assert (rec["acceptance_sum"], rec["n_steps"]) == (16, 4)
