"""EAGLE-3 drafters (`drafting.eagle3`: torch, mlx): the three checkpoint dialects read, drafts
equal to an independent reference (`eagle3ckpt.reference_draft`, from vLLM's and speculators' code) and to
mlx-vlm 0.7.10's drafter through accept-all / accept-none / partial steps and rollbacks; output equal to
the runtime's own greedy generation on the HF and MLX verifiers with both drafter runtimes, chains and
trees; T > 0 seeded match and the rejection rule's distribution; malformed checkpoints refused in one line
before the verifier loads; `specdec inspect-drafter`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
import eagle3ckpt  # noqa: E402
import parity  # noqa: E402
import tinymodels  # noqa: E402
from drafters import assert_turns_equal_fresh_runs, drafter_logits, scripted_steps  # noqa: E402

from specdec.api import load_drafter  # noqa: E402
from specdec.drafting.eagle3.config import read_eagle3  # noqa: E402
from specdec.drafting.eagle3.torch import Eagle3Drafter  # noqa: E402
from specdec.drafting.load import check_drafter, check_drafter_fits  # noqa: E402
from specdec.engine import DecodeConfig, generate  # noqa: E402
from specdec.formats import identify  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.tree import TreeBudget  # noqa: E402
from specdec.verifiers.hf import HFVerifier  # noqa: E402

mlx_lm = pytest.importorskip("mlx_lm")
from specdec.verifiers.mlx import MLXVerifier  # noqa: E402

PROMPT = [(7 * i) % 250 + 5 for i in range(24)]
CPU = torch.device("cpu")
#: checkpoint variants: (dialect, tiny_eagle3 options)
VARIANTS = {
    "speculators": ("speculators", dict(aux=[1, 2, 4], draft_vocab=200)),
    "yuhuili": ("yuhuili", dict(aux=None, draft_vocab=200)),
    "sglang": ("SGLang", dict(aux=None)),
    "qwen3-2layers-fcnorm-normout": ("speculators", dict(aux=[4, 1, 3], qwen3=True, layers=2,
                                                        flags={"fc_norm": True, "norm_output": True})),
    "normfc-residual-embed": ("speculators", dict(aux=[2, 3, 4], embed=True, draft_vocab=160, flags={
        "norm_before_fc": True, "norm_before_residual": True})),
}  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tinymodels.tiny_tokenizer(tinymodels.tiny_llama(tmp_path_factory.mktemp("e3") / "llama"))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e3ckpt")
    return {
        name: eagle3ckpt.tiny_eagle3(root / name, target_hidden=64, vocab=320, dialect=d, seed=i, **kw)
        for i, (name, (d, kw)) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="module")
def hf(llama) -> HFVerifier:
    return HFVerifier(llama)


@pytest.fixture(scope="module")
def mlxv(llama) -> MLXVerifier:
    return MLXVerifier(llama)


def test_dialects_identified_and_read(ckpts):
    for name, (dialect, kw) in VARIANTS.items():
        folder = ckpts[name]
        raw = json.loads((folder / "config.json").read_text())
        fmt = identify(raw, {p.name for p in folder.iterdir()})
        assert (fmt.family, fmt.dialect) == ("eagle3", dialect), name
        cfg = read_eagle3(folder, raw, dialect=dialect)
        assert cfg.has_embed == bool(kw.get("embed")) and cfg.num_layers == kw.get("layers", 1)
        assert cfg.aux_layer_ids == (tuple(kw["aux"]) if kw["aux"] else None)
    assert read_eagle3(ckpts["speculators"], json.loads((ckpts["speculators"] / "config.json").read_text()),
                       dialect="speculators").block_size == 6  # speculative_tokens 5 + 1  # fmt: skip


def torch_reference(folder: Path, v):
    emb = v.embed_fn(device=CPU, dtype=torch.float32)(torch.arange(v.vocab_size))

    def ref(tokens, feats, last, k):
        return eagle3ckpt.reference_draft(folder, emb, tokens, feats, last, k)

    return ref


@pytest.mark.parametrize("name", list(VARIANTS))
def test_drafts_equal_the_reference_through_accepts_rejects_and_rollbacks(ckpts, hf, name):
    d = load_drafter(str(ckpts[name]), verifier=hf, block_size=5)
    assert isinstance(d, Eagle3Drafter)
    scripted_steps(d, hf, torch_reference(ckpts[name], hf), prompt=PROMPT)


@pytest.mark.parametrize("name", ["speculators", "qwen3-2layers-fcnorm-normout", "normfc-residual-embed"])
def test_mlx_drafter_equals_the_reference(ckpts, mlxv, name):
    d = load_drafter(str(ckpts[name]), verifier=mlxv, block_size=5, runtime="mlx")
    assert d.runtime == "mlx"
    scripted_steps(d, mlxv, torch_reference(ckpts[name], mlxv), prompt=PROMPT)


def test_drafts_equal_mlx_vlm(ckpts, mlxv):
    """mlx-vlm 0.7.10's EAGLE-3 drafter, fed the same target hidden states and the same commits (its
    prefill / draft_block / accept_verified_tokens), drafts the same tokens with logits to 1e-4 at every
    step. Its loader drops the embedding module of a checkpoint that ships none (the usual case), so the
    model is built here and bound to the target's embeddings."""
    pytest.importorskip("mlx_vlm")
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config as VlmConfig
    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

    folder = ckpts["speculators"]
    peer = Eagle3DraftModel(VlmConfig.from_dict(json.loads((folder / "config.json").read_text())))
    peer.load_weights(list(peer.sanitize(mx.load(str(folder / "model.safetensors"))).items()), strict=False)
    peer.bind(mlxv.model)
    d = load_drafter(str(folder), verifier=mlxv, block_size=5, runtime="mlx")
    state = {}

    state = {"len": 0, "drafts": []}

    def ref(tokens, feats, last, k):  # the peer, advanced by the commits since its last call
        if not state["len"]:
            peer.reset(mlxv.model)
            hid = mx.array(feats.numpy())[None]  # [1, P, 3H]
            peer.prefill_from_target_hidden(mx.array([tokens]), hid, last, None, greedy=True)
        else:  # commits [bonus, *drafts[:a]]: the peer pairs them with the features of their positions
            a = len(tokens) - state["len"] - 1
            hid = mx.array(feats[state["len"] :].numpy())[None]  # [1, a + 1, 3H]
            peer.accept_verified_tokens(hid, mx.array([state["drafts"]]), a, [last], None, greedy=True)
        first = torch.tensor(np.array(peer._logits(peer._seed_hidden)[0, 0].astype(mx.float32)))  # [K]
        block = peer.draft_block(last, None, None, k + 1, None, greedy=True)[0].tolist()
        state.update(len=len(tokens), drafts=block)
        return block, first

    steps = scripted_steps_peer(d, mlxv, ref)
    assert len(steps) == 7


def scripted_steps_peer(drafter, v, ref, k: int = 4) -> list[list[int]]:
    """`scripted_steps` without rollbacks (mlx-vlm's drafter has none: it trims only its own chain)."""
    v.reset()
    v.set_target_layers(drafter.target_layer_ids)
    last = v.prefill(PROMPT)
    drafter.reset()
    drafter.extend(v.native_features(len(PROMPT)), PROMPT)
    tokens, feats_all = list(PROMPT), v.features(len(PROMPT), device=CPU, dtype=torch.float32)
    out = []
    for a in [k, 0, 2, k, 1, 3, 0]:
        want, first = ref(tokens, feats_all, last, k)
        got = drafter.propose(last, k)
        assert got == want, (a, got, want)
        torch.testing.assert_close(drafter_logits(drafter, last, k)[0], first, atol=1e-4, rtol=1e-4)
        out.append(got)
        commit = [last, *got[:a]]
        target = v.verify(commit)
        feats = v.features(len(commit), device=CPU, dtype=torch.float32)
        drafter.extend(v.native_features(len(commit)), commit)
        tokens += commit
        feats_all = torch.cat([feats_all, feats])
        last = target[-1] if a == k or target[-1] != got[a] else (got[a] + 1) % 300
    return out


# ---- end to end: exact on every family and runtime ------------------------------------------------------

FAMILIES = {
    "llama": (tinymodels.tiny_llama, None),
    "qwen3": (tinymodels.tiny_qwen3, None),
    "gemma3": (tinymodels.tiny_gemma3, None),  # sliding window 16: wraps within the run
    "gemma4": (tinymodels.tiny_gemma4, None),
    "gpt_oss": (tinymodels.tiny_gpt_oss, None),
    "qwen3_5": (tinymodels.tiny_qwen3_5, [1, 2, 5]),  # aux states after Gated DeltaNet layers: well defined
}


def run(v, drafter=None, *, n: int = 24, block: int = 5, prompt=PROMPT, sampling=None, tree=None):
    cfg = DecodeConfig(max_new_tokens=n, block_size=block if drafter else 1, stop_token_ids=frozenset(),
                       sampling=sampling, tree=tree)  # fmt: skip
    return generate(v, prompt, drafter=drafter, cfg=cfg)


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_output_equals_the_runtimes_own_greedy_generation(tmp_path, fam):
    """HF verifier with the torch drafter, MLX verifier with both drafter runtimes; chains and trees; the
    output is the runtime's own greedy generation (transformers' `generate`, mlx_lm's `generate_step`)."""
    make, aux = FAMILIES[fam]
    folder = make(tmp_path / fam)
    hf = HFVerifier(folder)
    ck = eagle3ckpt.tiny_eagle3(tmp_path / "e3", target_hidden=hf.hidden_size, vocab=hf.vocab_size, aux=aux,
                                draft_vocab=hf.vocab_size // 2)  # fmt: skip
    own = parity.runtime_generate(hf.model, PROMPT, 24)
    d = load_drafter(str(ck), verifier=hf)
    assert run(hf, d).output_tokens == own
    if trees(hf):
        assert run(hf, d, tree=TreeBudget(nodes=10)).output_tokens == own
    mv = MLXVerifier(folder)
    own = parity.mlx_lm_greedy(mv, PROMPT, 24)
    for runtime in ("torch", "mlx"):
        d = load_drafter(str(ck), verifier=mv, runtime=runtime)
        assert run(mv, d).output_tokens == own, runtime
        if trees(mv):
            assert run(mv, d, tree=TreeBudget(nodes=10)).output_tokens == own, runtime


def trees(v) -> bool:
    """The verifier verifies trees (gpt-oss's sinks and Gated DeltaNet layers do not: refused in one line)."""
    try:
        v.check_tree()
    except ValueError as e:
        assert "use a chain" in str(e)
        return False
    return True


@pytest.mark.parametrize("rt", ["hf", "mlx"])
def test_sampled_walks_multi_turn_and_cuts(ckpts, hf, mlxv, rt):
    """T > 0: seeded, sampled drafts under the match rule give AR's sampled tokens; a confidence cut and
    verify costs only shorten drafts; a streaming engine's turns (a continued history, then an edited one
    the drafter rolls back over) equal fresh runs."""
    v = hf if rt == "hf" else mlxv
    runtime = "torch" if rt == "hf" else "mlx"
    spec = str(ckpts["speculators"])
    d = load_drafter(spec, verifier=v, runtime=runtime)
    ar = run(v).output_tokens
    match = SamplingParams(temperature=0.9, seed=4, rule="match", proposal="sample")
    assert run(v, d, sampling=match).output_tokens == run(v, sampling=match).output_tokens
    cut = load_drafter(spec, verifier=v, runtime=runtime, min_confidence=0.9)
    res = run(v, cut)
    assert res.output_tokens == ar and sum(s.drafted for s in res.decode_steps) < 4 * len(res.decode_steps)
    assert_turns_equal_fresh_runs(v, d, PROMPT, lambda ids: run(v, prompt=ids, n=12).output_tokens)


# ---- the rejection rule's distribution with sampled walks (the stub: small vocabulary) ---------------------


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["walk", "broken-walk"])
def test_sampled_walk_with_rejection_keeps_the_verifiers_distribution(tmp_path, monkeypatch, broken):
    """Chi-square of the first three tokens against the exact distribution (tests/test_sampling.py's
    harness), drafts sampled from the EAGLE-3 walk and verified by `rejection`. Negative control: a walk
    that reports its q rows shifted by one token must fail."""
    from test_sampling import V as SV
    from test_sampling import check_walk_distribution

    from specdec.verifiers.stub import StubConfig, StubVerifier

    v = StubVerifier(StubConfig(vocab_size=SV, logit_scale=1.5, hidden_size=16, num_layers=3, num_heads=2,
                                intermediate_size=32, max_context=64))  # fmt: skip
    ck = eagle3ckpt.tiny_eagle3(tmp_path / "e3", target_hidden=16, vocab=SV, aux=[1, 2, 3], heads=2,
                                kv_heads=1, sharpen=2.0)  # fmt: skip
    d = load_drafter(str(ck), verifier=v)
    check_walk_distribution(v, d, Eagle3Drafter, monkeypatch, broken=broken)


# ---- malformed checkpoints: one line, before the verifier loads -----------------------------------------


def _patched(
    src: Path, dst: Path, *, config: dict | None = None, weights=None, truncate: bool = False
) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        raw = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**raw, **config}))
    if weights:
        sd = weights(load_file(str(dst / "model.safetensors")))
        save_file(sd, str(dst / "model.safetensors"))
    if truncate:
        f = next(p for p in dst.iterdir() if p.name.endswith((".safetensors", ".bin")))
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return dst


MALFORMED = {
    "missing fc": (dict(weights=lambda sd: {k: v for k, v in sd.items() if k != "fc.weight"}),
                   "is missing fc.weight"),
    "d2t length": (dict(weights=lambda sd: {**sd, "d2t": sd["d2t"][:-1]}), "d2t [199] (expected [200]"),
    "d2t range": (dict(weights=lambda sd: {**sd, "d2t": sd["d2t"] + 500}), "d2t maps draft tokens outside"),
    "aux out of range": (dict(config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}),
                         "reads aux layers [9]"),
    "aux zero": (dict(config={"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}),
                 "aux layer id 0 reads the token"),
    "hidden size": (dict(config={"target_hidden_size": 32},
                         weights=lambda sd: {**sd, "fc.weight": sd["fc.weight"][:, :96].contiguous()}),
                    "reads hidden states of width 32"),
    "shape": (dict(weights=lambda sd: {**sd, "norm.weight": sd["norm.weight"][:10].contiguous()}),
              "has wrong shapes: norm.weight [10] (expected [64])"),
    "extra weight": (dict(weights=lambda sd: {**sd, "layers.0.mlp.bias": sd["norm.weight"].clone()}),
                     "has unexpected weights layers.0.mlp.bias"),
    "truncated": (dict(truncate=True), "truncated or not a weights file"),
    "layer type": (dict(config={"transformer_layer_config": {"model_type": "gpt2"}}), "model_type 'gpt2'"),
}  # fmt: skip


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_checkpoints_are_one_line_before_the_verifier_loads(ckpts, llama, tmp_path, capsys,
                                                                      monkeypatch, case):  # fmt: skip
    from specdec.cli import main

    opts, says = MALFORMED[case]
    bad = _patched(ckpts["speculators"], tmp_path / "bad", **opts)

    def no_load(*a, **kw):
        raise AssertionError("the verifier loaded before the drafter was checked")

    monkeypatch.setattr(HFVerifier, "__init__", no_load)
    rc = main(["generate", "--verifier", "hf", "--model", str(llama), "--drafter", str(bad), "--prompt", "x"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:") or "Traceback" in ln]
    assert rc == 2 and len(lines) == 1 and says in lines[0], err


def test_a_truncated_pytorch_model_bin_and_no_code_runs(ckpts, tmp_path):
    """yuhuili's pytorch_model.bin is read with weights_only: a pickle that would run code is refused."""
    bad = _patched(ckpts["yuhuili"], tmp_path / "trunc", truncate=True)
    with pytest.raises(ValueError, match="truncated or not a weights file"):
        check_drafter(str(bad))
    evil = shutil.copytree(ckpts["yuhuili"], tmp_path / "evil")
    torch.save({"x": torch.zeros(1), "y": Path("/")}, evil / "pytorch_model.bin")  # not a plain tensor dict
    with pytest.raises(ValueError, match=r"truncated or not a weights file|no plain name"):
        check_drafter(str(evil))


def test_fits_before_loading_and_inspect_drafter(ckpts, llama, capsys):
    from types import SimpleNamespace

    from specdec.cli import main

    plan = check_drafter(str(ckpts["yuhuili"]))
    shape = SimpleNamespace(model_name="big", num_layers=40, hidden_size=64, vocab_size=320)
    check_drafter_fits(plan, shape)  # default aux ids [2, 20, 37] fit a 40-layer target of that width
    with pytest.raises(ValueError, match="vocabulary size 320, 'big' has 321"):
        check_drafter_fits(plan, SimpleNamespace(**{**shape.__dict__, "vocab_size": 321}))
    assert main(["inspect-drafter", str(ckpts["speculators"]), "--model", str(llama)]) == 0
    out = capsys.readouterr().out
    assert "format: an EAGLE-3 drafter (speculators format)" in out and "made for: tiny-target" in out
    assert "aux hidden states [1, 2, 4]" in out and f"fits {llama.name}: yes" in out
    assert main(["inspect-drafter", str(llama)]) == 2
    cap = capsys.readouterr()
    assert "format: a causal LM" in cap.out and cap.err.count("error:") == 1
    assert main(["inspect-drafter", str(ckpts["speculators"]), "--model", str(llama / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_hub_repo_id_fetches_what_eagle3_dialects_ship(monkeypatch, tmp_path):
    """A drafter repo id fetches config.json and the weights only: safetensors, and yuhuili's
    pytorch_model.bin (read with weights_only), never code."""
    import huggingface_hub

    from specdec import models

    seen = {}

    def fake(repo, **kw):
        seen.update(kw, repo=repo)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.setattr(models, "_hub_reachable", lambda: True)
    assert models.resolve_drafter("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B") == tmp_path
    assert set(seen["allow_patterns"]) == {
        "config.json",
        "generation_config.json",
        "*.safetensors",
        "pytorch_model.bin",
    }


# ---- P-EAGLE: the block in one forward ------------------------------------------------------------------


@pytest.fixture(scope="module")
def peagle(tmp_path_factory) -> Path:
    return eagle3ckpt.tiny_eagle3(tmp_path_factory.mktemp("peagle") / "pe", target_hidden=64, vocab=320,
                                  aux=[1, 2, 4], draft_vocab=200, parallel_mask=319, seed=7)  # fmt: skip


def test_peagle_drafts_equal_the_reference_and_output_is_greedy(peagle, hf, mlxv, llama):
    """Every proposal equals speculators' P-EAGLE forward recomputed from scratch (the context rows, then
    mask rows) through accepted, rejected and partial steps and rollbacks; output equals the runtimes' own
    greedy generation, in chains, trees and seeded sampling, in both drafter runtimes."""
    from specdec.drafting.eagle3.torch import PEagleDrafter

    d = load_drafter(str(peagle), verifier=hf, block_size=5)
    assert isinstance(d, PEagleDrafter) and not d.walks
    emb = hf.embed_fn(device=CPU, dtype=torch.float32)(torch.arange(hf.vocab_size))

    def ref(tokens, feats, last, k):
        return eagle3ckpt.reference_parallel(peagle, emb, tokens, feats, last, k)

    def logits_of(drafter, last, k):  # the parallel block's logits, what `scripted_steps` compares
        return drafter.parallel_logits(last, k).float()

    scripted_steps(d, hf, ref, prompt=PROMPT, logits=logits_of)
    own = parity.runtime_generate(hf.model, PROMPT, 24)
    assert run(hf, d).output_tokens == own
    assert run(hf, d, tree=TreeBudget(nodes=10)).output_tokens == own
    match = SamplingParams(temperature=0.9, seed=4, rule="match", proposal="sample")
    assert run(hf, d, sampling=match).output_tokens == run(hf, sampling=match).output_tokens
    own = parity.mlx_lm_greedy(mlxv, PROMPT, 24)
    for runtime in ("torch", "mlx"):
        dm = load_drafter(str(peagle), verifier=mlxv, runtime=runtime, block_size=5)
        assert run(mlxv, dm).output_tokens == own and not dm.walks, runtime
        assert run(mlxv, dm, tree=TreeBudget(nodes=10)).output_tokens == own, runtime
    mlx_d = load_drafter(str(peagle), verifier=mlxv, runtime="mlx", block_size=5)

    def mlx_logits(drafter, last, k):
        return torch.tensor(np.array(drafter.parallel_logits(last, k)))

    scripted_steps(mlx_d, mlxv, torch_reference_parallel(peagle, mlxv), prompt=PROMPT, logits=mlx_logits)


def torch_reference_parallel(folder: Path, v):
    emb = v.embed_fn(device=CPU, dtype=torch.float32)(torch.arange(v.vocab_size))

    def ref(tokens, feats, last, k):
        return eagle3ckpt.reference_parallel(folder, emb, tokens, feats, last, k)

    return ref
