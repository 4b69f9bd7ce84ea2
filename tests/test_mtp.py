"""`--drafter mtp` (`specdec.drafting.mtp.torch`): the verifier's own MTP layers on tiny Qwen3.5 (dense, MoE,
multimodal checkpoint) and Qwen3-Next models with MTP weights as the real checkpoints ship them. Drafts and
logits equal transformers 5.25's own MTP layer (`MtpModel`) recomputed from scratch at every depth on the
main model's own normed hidden states, through accept-all / accept-none / partial steps and rollbacks;
output equals transformers' greedy generation; seeded T > 0 match; multi-turn reuse; a model without MTP
layers, a conversion that dropped them and the MLX verifier are one line before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import parity
import tinymodels
from drafters import assert_turns_equal_fresh_runs, scripted_steps

from specdec.api import load_drafter
from specdec.drafting.mtp.torch import MtpDrafter, load_mtp_model
from specdec.engine import DecodeConfig, generate
from specdec.sampling import SamplingParams
from specdec.verifiers.hf import HFVerifier

PROMPT = [(7 * i) % 250 + 5 for i in range(24)]


def run(v, drafter=None, *, n: int = 24, block: int = 4, prompt=PROMPT, sampling=None):
    cfg = DecodeConfig(max_new_tokens=n, block_size=block if drafter else 1, stop_token_ids=frozenset(),
                       sampling=sampling)  # fmt: skip
    return generate(v, prompt, drafter=drafter, cfg=cfg)


MAKERS = {
    "qwen3_5": lambda p: tinymodels.tiny_qwen3_5(p, multimodal=False),
    "qwen3_5_moe": lambda p: tinymodels.tiny_qwen3_5(p, moe=True, multimodal=False),
    "qwen3_5_multimodal": tinymodels.tiny_qwen3_5,
    "qwen3_next": tinymodels.tiny_qwen3_next,
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    return {k: tinymodels.add_mtp(make(root / k)) for k, make in MAKERS.items()}


def transformers_reference(v: HFVerifier):
    """Drafts by transformers' own MTP layer, a second `MtpModel` loaded from the checkpoint, recomputed
    from an empty `MtpCache` at every depth on the main model's own `hidden_states[-1]` (normed)."""
    from transformers.cache_utils import MtpCache

    mtp = load_mtp_model(v.model, 1, cpu_linears=False)  # as transformers runs it

    @torch.no_grad()
    def ref(tokens, feats, last, k):
        hs = v.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1]  # [1, L, H]
        ids, drafts, logits = [*tokens[1:], last], [], []
        for _ in range(k):
            cache = MtpCache(config=mtp.config)
            pos = torch.arange(1, hs.shape[1] + 1)[None]
            out = mtp.forward_layer(0, hs, pos, cache, input_ids=torch.tensor([ids]))
            lg = mtp._project_to_logits(out[:, -1])[0]
            drafts.append(int(lg.argmax()))
            logits.append(lg)
            hs, ids = torch.cat([hs, out[:, -1:]], 1), [*ids, drafts[-1]]
        return drafts, torch.stack(logits)  # the main model ran on a cache of its own, not the verifier's

    return ref


@pytest.mark.parametrize("fam", list(MAKERS))
def test_drafts_equal_transformers_mtp_layer(folders, fam):
    v = HFVerifier(folders[fam])
    d = load_drafter("mtp", verifier=v, block_size=5)
    assert isinstance(d, MtpDrafter) and d.target_layer_ids == (v.num_layers - 1,)
    scripted_steps(d, v, transformers_reference(v), prompt=PROMPT)


@pytest.mark.parametrize("fam", list(MAKERS))
def test_mlx_drafts_equal_transformers_mtp_layer(folders, fam):
    """On the MLX verifier (mlx_lm drops the mtp.* weights; the layer is built from its own layer class):
    the same drafts and logits (to 1e-4) as transformers' MTP layer on transformers' hidden states."""
    pytest.importorskip("mlx_lm")
    from specdec.drafting.mtp.mlx import MLXMtpDrafter
    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(folders[fam])
    d = load_drafter("mtp", verifier=v, block_size=5)
    assert isinstance(d, MLXMtpDrafter) and d.runtime == "mlx"
    scripted_steps(d, v, transformers_reference(HFVerifier(folders[fam])), prompt=PROMPT)


def test_mlx_output_is_mlx_lms_own_greedy_and_turns(folders):
    pytest.importorskip("mlx_lm")
    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(folders["qwen3_5"])
    d = load_drafter("mtp", verifier=v)
    assert run(v, d).output_tokens == parity.mlx_lm_greedy(v, PROMPT, 24)
    match = SamplingParams(temperature=0.9, seed=4, rule="match", proposal="sample")
    assert run(v, d, sampling=match).output_tokens == run(v, sampling=match).output_tokens
    assert_turns_equal_fresh_runs(v, d, PROMPT, lambda ids: run(v, prompt=ids, n=12).output_tokens)


@pytest.mark.parametrize("fam", ["qwen3_5", "qwen3_next"])
def test_output_is_greedy_sampled_match_and_turns(folders, fam):
    v = HFVerifier(folders[fam])
    d = load_drafter("mtp", verifier=v)
    own = parity.runtime_generate(v.model, PROMPT, 24)
    assert run(v, d, block=4).output_tokens == own
    match = SamplingParams(temperature=0.9, seed=4, rule="match", proposal="sample")
    assert run(v, d, block=4, sampling=match).output_tokens == run(v, sampling=match).output_tokens
    cut = load_drafter("mtp+lookup", verifier=v, min_confidence=0.5)
    assert run(v, cut, block=4).output_tokens == own
    assert_turns_equal_fresh_runs(v, d, PROMPT, lambda ids: run(v, prompt=ids, n=12).output_tokens)
    assert d.describe()["mtp_layers"] == 1


def test_refusals_before_anything_loads(folders, tmp_path, capsys, monkeypatch):
    from specdec.cli import main

    plain = tinymodels.tiny_tokenizer(tinymodels.tiny_qwen3(tmp_path / "plain"))
    dropped = tinymodels.tiny_tokenizer(tinymodels.tiny_qwen3_5(tmp_path / "dropped", multimodal=False))
    raw = json.loads((dropped / "config.json").read_text())
    (dropped / "config.json").write_text(json.dumps({**raw, "mtp_num_hidden_layers": 1}))

    def no_load(*a, **kw):
        raise AssertionError("the verifier loaded before the drafter was checked")

    monkeypatch.setattr(HFVerifier, "__init__", no_load)
    for folder, says in ((plain, "has no MTP layers"), (dropped, "its weights hold no mtp.* tensors")):
        rc = main(
            ["generate", "--verifier", "hf", "--model", str(folder), "--drafter", "mtp", "--prompt", "x"]
        )
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("error:") or "Traceback" in ln]
        assert rc == 2 and len(lines) == 1 and says in lines[0], err
    monkeypatch.undo()
    pytest.importorskip("mlx_lm")
    from specdec.verifiers.mlx import MLXVerifier

    with pytest.raises(ValueError, match=r"its weights hold no mtp\.\* tensors"):  # an MLX conversion's loss
        load_drafter("mtp", verifier=MLXVerifier(dropped))


def mlx_vlm_peer(folder: Path, text: dict, weights: dict | None = None, quantization: dict | None = None):
    """mlx-vlm 0.7.10's `qwen3_5_mtp` drafter for the model of text config `text`: the `mtp.*` tensors of
    checkpoint `folder` through its own sanitize, or with `weights` a split folder's as they lie (quantized
    as its loader quantizes them where `quantization` says)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.qwen3_5_mtp import Qwen3_5MTPDraftModel

    # mlx-vlm asks for the multimodal RoPE sections real configs carry; on text they are plain RoPE
    rope = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    peer = Qwen3_5MTPDraftModel(
        Qwen3_5MTPConfig.from_dict({"text_config": {**text, "rope_parameters": rope}})
    )
    if weights is None:
        raw = {k: v for k, v in mx.load(str(folder / "model.safetensors")).items() if k.startswith("mtp.")}
        weights = peer.sanitize(raw)
    if quantization:
        nn.quantize(peer, quantization["group_size"], quantization["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in weights)  # fmt: skip
    peer.load_weights(list(weights.items()), strict=True)
    return peer


def first_blocks(d, v, peer) -> tuple[list[int], list[int]]:
    """The first block of drafter `d` on MLXVerifier `v` after PROMPT, and mlx-vlm's `peer` fed the
    verifier's final-normed hidden states."""
    import mlx.core as mx

    from specdec.bridges.mlx import text_model

    peer.reset(v.model)
    v.reset()
    v.set_target_layers(d.target_layer_ids)
    last = v.prefill(PROMPT)
    feats = v.native_features(len(PROMPT))
    d.reset()
    d.extend(feats, PROMPT)
    normed = text_model(v.model).model.norm(feats)
    peer.prefill_from_target_hidden(mx.array([PROMPT]), normed[None], last, None, greedy=True)
    return d.propose(last, 4), peer.draft_block(last, None, None, 5, None, greedy=True)[0].tolist()


def test_first_block_equals_mlx_vlm(folders):
    """mlx-vlm 0.7.10's `qwen3_5_mtp` drafter, fed the verifier's final-normed hidden states, drafts the
    same first block. (Past it, mlx-vlm keeps the K/V of accepted chain rows, computed from its own
    predicted hidden states rather than the verifier's, so later blocks may differ by design; specdec
    recomputes them as transformers does, tested above.)"""
    pytest.importorskip("mlx_vlm")
    from specdec.verifiers.mlx import MLXVerifier

    folder = folders["qwen3_5_multimodal"]
    peer = mlx_vlm_peer(folder, json.loads((folder / "config.json").read_text())["text_config"])
    v = MLXVerifier(folder)
    ours, theirs = first_blocks(load_drafter("mtp", verifier=v, block_size=5), v, peer)
    assert ours == theirs


def split_by_mlx_vlm(src: Path, out: Path, bits: int | None = None) -> Path:
    """`src`'s MTP layers split into `out` by mlx-vlm 0.7.10's own splitter (as `mlx_vlm.convert --mtp`
    writes them), quantized to `bits` in groups of 32 where given."""
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.split import Qwen3_5MTPSplitter, Qwen3NextMTPSplitter

    nxt = json.loads((src / "config.json").read_text())["model_type"] == "qwen3_next"
    q = {"q_bits": bits, "q_group_size": 32} if bits else {}
    (Qwen3NextMTPSplitter if nxt else Qwen3_5MTPSplitter)().split(str(src), str(out), **q)
    return out


@pytest.mark.parametrize("fam", list(MAKERS))
def test_split_folder_drafts_equal_transformers_mtp_layer(folders, tmp_path, fam):
    """mlx-vlm's split folder of the model's MTP layers (`--drafter <folder>`, drafter runtime mlx) drafts
    what transformers' MTP layer does on transformers' hidden states, through accepted, rejected and
    partial steps and rollbacks: the same drafter as `--drafter mtp`, its weights from the folder."""
    pytest.importorskip("mlx_vlm")
    from specdec.drafting.mtp.mlx import MLXMtpDrafter
    from specdec.verifiers.mlx import MLXVerifier

    split = split_by_mlx_vlm(folders[fam], tmp_path / "split")
    v = MLXVerifier(folders[fam])
    d = load_drafter(str(split), verifier=v, runtime="mlx", block_size=5)
    assert isinstance(d, MLXMtpDrafter) and d.describe()["split_folder"] == str(split)
    scripted_steps(d, v, transformers_reference(HFVerifier(folders[fam])), prompt=PROMPT)


@pytest.mark.parametrize("fam", ["qwen3_5_multimodal", "qwen3_5_moe"])
def test_quantized_split_folder_is_mlx_vlms_and_output_greedy(folders, tmp_path, fam):
    """A 4-bit split (`mlx_vlm.convert --mtp -q`): its first block equals mlx-vlm's own drafter on the same
    folder; the output is mlx_lm's greedy generation, seeded T > 0 matches, a second turn reuses."""
    pytest.importorskip("mlx_vlm")
    import mlx.core as mx

    from specdec.verifiers.mlx import MLXVerifier

    split = split_by_mlx_vlm(folders[fam], tmp_path / "split4", bits=4)
    cfg = json.loads((split / "config.json").read_text())
    v = MLXVerifier(folders[fam])
    d = load_drafter(str(split), verifier=v, runtime="mlx", block_size=5)
    assert d.describe()["quantization"]["bits"] == 4
    if fam == "qwen3_5_multimodal":  # mlx-vlm's drafter class is Qwen3.5's dense one
        weights = mx.load(str(split / "model.safetensors"))
        peer = mlx_vlm_peer(split, cfg["text_config"], weights, cfg["quantization"])
        ours, theirs = first_blocks(d, v, peer)
        assert ours == theirs
    d = load_drafter(str(split), verifier=v, runtime="mlx")
    assert run(v, d).output_tokens == parity.mlx_lm_greedy(v, PROMPT, 24)
    match = SamplingParams(temperature=0.9, seed=4, rule="match", proposal="sample")
    assert run(v, d, sampling=match).output_tokens == run(v, sampling=match).output_tokens
    assert_turns_equal_fresh_runs(v, d, PROMPT, lambda ids: run(v, prompt=ids, n=12).output_tokens)


def test_split_folder_refusals(folders, tmp_path, capsys):
    """Before the verifier loads, in one line: the HF verifier (MLX-layout weights), another model's
    verifier, a split of a kind specdec does not read, weights that lack a tensor, quantized weights
    without their config; as --model it is named a drafter. `inspect-drafter` says what it holds."""
    pytest.importorskip("mlx_vlm")
    import shutil

    from specdec.cli import main

    src = folders["qwen3_5"]
    split = split_by_mlx_vlm(src, tmp_path / "split")
    cfg = json.loads((split / "config.json").read_text())

    def variant(name: str, config: dict, drop: str | None = None) -> Path:
        out = tmp_path / name
        shutil.copytree(split, out)
        (out / "config.json").write_text(json.dumps(config))
        if drop:
            from safetensors.numpy import load_file, save_file

            w = load_file(str(out / "model.safetensors"))
            save_file({k: a for k, a in w.items() if k != drop}, str(out / "model.safetensors"))
        return out

    other = tinymodels.add_mtp(tinymodels.tiny_qwen3_next(tmp_path / "next"))

    def mlx(drafter: Path) -> list[str]:
        return [
            "--verifier",
            "mlx",
            "--model",
            str(src),
            "--drafter",
            str(drafter),
            "--drafter-runtime",
            "mlx",
        ]

    cases = [
        (["--verifier", "hf", "--model", str(src), "--drafter", str(split)], "runs in ['mlx']"),
        (mlx(split)[:-2], "(--verifier mlx --drafter-runtime mlx), not torch"),
        (["--verifier", "mlx", "--model", str(other), "--drafter", str(split), "--drafter-runtime", "mlx"],
         "the MTP weights do not fit this model's full-attention layer"),
        (mlx(variant("nemo", {**cfg, "model_type": "nemotron_h_mtp"})),
         "MTP layers of model_type 'nemotron_h_mtp'; specdec reads ['qwen3_5_mtp']"),
        (mlx(variant("nofc", cfg, drop="fc.weight")), "its weights lack ['fc.weight']"),
        (mlx(variant("wide", {**cfg, "text_config": {**cfg["text_config"], "hidden_size": 96}})),
         "MTP layers split from a model of hidden size 96"),
    ]  # fmt: skip
    q = split_by_mlx_vlm(src, tmp_path / "q", bits=4)
    qcfg = {k: v for k, v in json.loads((q / "config.json").read_text()).items() if "quantization" not in k}
    (q / "config.json").write_text(json.dumps(qcfg))
    cases.append((mlx(q), "no quantization"))
    cases.append((["--verifier", "mlx", "--model", str(split)], "holds MTP drafter layers (split format)"))
    for args, says in cases:
        rc = main(["generate", *args, "--prompt", "x", "--max-new-tokens", "2"])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("error:") or "Traceback" in ln]
        assert rc == 2 and len(lines) == 1 and says in lines[0], (args, err)
    assert main(["inspect-drafter", str(split), "--model", str(src)]) == 0
    out = capsys.readouterr().out
    assert "MTP drafter layers (split format)" in out and "mtp-split" in out and "fits" in out, out


@pytest.mark.parametrize("quantize", [False, True], ids=["mlx", "mlx-8bit"])
def test_add_mtp_beside_an_mlx_conversion(folders, tmp_path, capsys, quantize):
    """mlx_lm's converter drops mtp.*: refused in one line naming the fix; `specdec add-mtp` copies them
    into a new file beside the conversion (nothing else in it changes, a second copy is refused), and the
    conversion then drafts as the original checkpoint does; a quantized one with the MTP layer quantized
    as its own layers are: mlx-vlm's `convert --mtp -q` split of the same layers, tensor for tensor."""
    pytest.importorskip("mlx_lm")
    import hashlib

    from mlx_lm import convert

    from specdec.cli import main
    from specdec.verifiers.mlx import MLXVerifier

    src = tinymodels.tiny_tokenizer(folders["qwen3_5_multimodal"])
    dst = tmp_path / "mlx"
    convert(hf_path=str(src), mlx_path=str(dst), quantize=quantize, q_group_size=32, q_bits=8)
    with pytest.raises(ValueError, match="specdec add-mtp <original> <folder>"):
        load_drafter("mtp", verifier=MLXVerifier(dst))
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dst.iterdir()}
    assert main(["add-mtp", str(src), str(dst)]) == 0
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dst.iterdir()}
    assert set(after) - set(before) == {"mtp.safetensors"} and all(after[k] == v for k, v in before.items())
    assert main(["add-mtp", str(src), str(dst)]) == 2 and "exists already" in capsys.readouterr().err
    v = MLXVerifier(dst)
    d = load_drafter("mtp", verifier=v)
    if not quantize:  # the original checkpoint's drafts
        ref = MLXVerifier(src)
        want = first_drafts(ref, load_drafter("mtp", verifier=ref))
    else:  # quantized as the model's own layers: mlx-vlm's `convert --mtp -q` split, tensor for tensor
        pytest.importorskip("mlx_vlm")
        import mlx.core as mx
        from mlx.utils import tree_flatten

        assert d.describe()["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
        split = split_by_mlx_vlm(src, tmp_path / "split8", bits=8)
        theirs = mx.load(str(split / "model.safetensors"))
        ours = dict(tree_flatten(d.model.mtp.parameters()))
        assert set(ours) == set(theirs) and all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)
        want = first_drafts(v, load_drafter(str(split), verifier=v, runtime="mlx"))
    assert first_drafts(v, d) == want
    assert run(v, load_drafter("mtp", verifier=v)).output_tokens == parity.mlx_lm_greedy(v, PROMPT, 24)


@pytest.mark.parametrize("recipe", ["mlx_lm", "mlp-only"])
def test_add_mtp_beside_a_quantized_moe_keeps_its_recipe(folders, tmp_path, recipe):
    """A 4-bit Qwen3.5-MoE conversion, by mlx_lm's recipe (router gates in 8 bits, groups of 64) or a mixed
    one (the MLPs alone): the MTP layer copied beside it is quantized module for module as the model's own
    full-attention layer (mlx-vlm's splitter leaves the router in float and quantizes the shared-expert
    gate to the default bits); the output stays mlx_lm's greedy generation."""
    pytest.importorskip("mlx_lm")
    import shutil

    from mlx_lm.utils import quantize_model, save_config, save_model

    from specdec.cli import main
    from specdec.drafting.mtp.mlx import _full_attention_index
    from specdec.verifiers.mlx import MLXVerifier

    src = tinymodels.tiny_tokenizer(folders["qwen3_5_moe"])
    fresh = MLXVerifier(src)
    own = fresh.model.quant_predicate
    which = own if recipe == "mlx_lm" else lambda path, m: ".mlp." in f"{path}." and own(path, m)
    model, config = quantize_model(fresh.model, fresh.config, group_size=32, bits=4, quant_predicate=which)
    dst = tmp_path / "q4"
    save_model(dst, model)
    save_config(config, dst / "config.json")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "generation_config")):
            shutil.copy(f, dst)
    assert main(["add-mtp", str(src), str(dst)]) == 0
    v = MLXVerifier(dst)
    d = load_drafter("mtp", verifier=v)
    assert d.describe()["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    fa = dict(v.model.language_model.model.layers[_full_attention_index(v.model)].named_modules())
    for name, m in d.model.mtp.layers[0].named_modules():
        if hasattr(fa.get(name), "bits"):
            assert (m.bits, m.group_size) == (fa[name].bits, fa[name].group_size), name
    assert d.model.mtp.layers[0].mlp.gate.bits == 8
    float_attention = recipe == "mlp-only"
    assert (not hasattr(d.model.mtp.layers[0].self_attn.o_proj, "bits")) == float_attention
    assert (not hasattr(d.model.mtp.fc, "bits")) == float_attention  # fc goes as the attention's o_proj
    assert run(v, d).output_tokens == parity.mlx_lm_greedy(v, PROMPT, 24)


def first_drafts(v, d) -> list[int]:
    """`d`'s first proposal of 3 after `v`'s prefill of PROMPT."""
    v.reset()
    v.set_target_layers(d.target_layer_ids)
    last = v.prefill(PROMPT)
    d.reset()
    d.extend(v.native_features(len(PROMPT)), PROMPT)
    return d.propose(last, 3)


def test_ours_stays_greedy_where_transformers_use_mtp_drifts(folders):
    """transformers 5.25's `generate(use_mtp=True)` on Qwen3.5 keeps one Gated DeltaNet state fewer than it
    verifies and parts from its own greedy output after a rejected draft (on this tiny model at token 3 of
    40, when this was written); specdec's MTP drafting stays on the greedy output. Only the latter is
    asserted: their drift is shown, not required."""
    v = HFVerifier(folders["qwen3_5"])
    d = load_drafter("mtp", verifier=v)
    greedy = parity.runtime_generate(v.model, PROMPT, 40)
    assert run(v, d, n=40).output_tokens == greedy
    ids = torch.tensor([PROMPT])
    try:
        theirs = v.model.generate(
            ids, do_sample=False, max_new_tokens=40, min_new_tokens=40, pad_token_id=0, use_mtp=True
        )[0, len(PROMPT) :].tolist()
    except Exception as e:  # their MTP path, not ours: shown, not tested
        print(f"transformers' use_mtp did not run here: {type(e).__name__}: {e}")
        return
    drift = next((i for i, (a, b) in enumerate(zip(theirs, greedy)) if a != b), None)
    print(f"transformers use_mtp parts from its greedy output at token {drift}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rt", "broken"),
    [("hf", False), ("hf", True), pytest.param("mlx", False, marks=pytest.mark.mlx)],
    ids=["hf-walk", "hf-broken-walk", "mlx-walk"],
)
def test_sampled_walk_with_rejection_keeps_the_verifiers_distribution(tmp_path, monkeypatch, rt, broken):
    """Chi-square of the first three tokens against the exact distribution (tests/test_sampling.py's
    harness: transformers' forward of a tiny Qwen3.5 with a 6-token vocabulary, enumerated), drafts
    sampled from the MTP layer's walk and verified by `rejection`, on the HF and the MLX verifier.
    Negative control: a walk that reports its q rows shifted by one token must fail."""
    from test_sampling import V as SV
    from test_sampling import check_walk_distribution

    # one block of the hybrid (3 Gated DeltaNet layers, one attention layer): the walk's statistics do not
    # need the verifier deep, and its 2000 samples cost half
    t = tinymodels.add_mtp(tinymodels.tiny_qwen3_5(tmp_path / "t", multimodal=False, vocab=SV, layers=4))
    ref = HFVerifier(t)
    if rt == "hf":
        v, cls = ref, MtpDrafter
    else:
        pytest.importorskip("mlx_lm")
        from specdec.drafting.mtp.mlx import MLXMtpDrafter as cls
        from specdec.verifiers.mlx import MLXVerifier

        v = MLXVerifier(t)
    d = load_drafter("mtp", verifier=v)
    assert isinstance(d, cls)
    check_walk_distribution(v, d, cls, monkeypatch, broken=broken, reference=ref)


# ---- mlx-vlm's own speculative decoding, the eval's peer -------------------------------------------------


def for_mlx_vlm(src: Path, out: Path) -> Path:
    """A copy of the tiny Qwen3.5 `src` whose rope config names the multimodal RoPE sections real
    checkpoints carry and mlx-vlm's config requires (text positions: the same rotation either way)."""
    import shutil

    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["rope_parameters"] |= {"mrope_section": [1, 1, 0], "mrope_interleaved": True}
    (out / "config.json").write_text(json.dumps(cfg))
    return tinymodels.tiny_tokenizer(out)


def test_mlx_vlm_peer_and_where_its_speculation_departs_from_greedy(folders, tmp_path):
    """`specdec eval`'s mlx-vlm peer beside the MLX verifier with `--drafter mtp`: mlx-vlm's own model and
    drafter from the same folder, its generation counted from its own rounds. On this tiny Qwen3.5 (Gated
    DeltaNet layers) mlx-vlm 0.7.10's speculative output departs from its own greedy output (which is
    mlx_lm's) where the model's top two logits are far from a tie; ours stays greedy."""
    pytest.importorskip("mlx_vlm")
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load

    from specdec.evals.peers import VLM, peer_runners
    from specdec.verifiers.mlx import MLXVerifier

    folder = for_mlx_vlm(folders["qwen3_5_multimodal"], tmp_path / "q35")
    v = MLXVerifier(folder)
    greedy = parity.mlx_lm_greedy(v, PROMPT, 32)
    d = load_drafter("mtp", verifier=v)
    assert run(v, d, n=32).output_tokens == greedy  # ours
    cfg = DecodeConfig(max_new_tokens=32, block_size=4, stop_token_ids=frozenset())
    runners, notes = peer_runners(v, cfg, d)
    assert "(mtp), greedy" in notes[VLM], notes
    got = runners[VLM](PROMPT)
    theirs = got["output_tokens"]
    assert len(theirs) == 32 and got["n_steps"] > 0 and got["acceptance_sum"] == 31
    model, _ = load(str(folder))
    vlm_ar = [int(t) for t, _ in generate_step(mx.array([PROMPT]), model, None, None, max_tokens=32,
                                               temperature=0.0)]  # fmt: skip
    assert vlm_ar == greedy  # mlx-vlm's own model decodes greedily as mlx_lm does
    n = next((i for i, (a, b) in enumerate(zip(theirs, greedy)) if a != b), None)
    if n is not None:  # mlx-vlm 0.7.10: a clear second choice, not a near-tie
        logits = v.model(mx.array([PROMPT + greedy[:n]]))[0, -1]
        print(f"mlx-vlm departs at {n}: margin {float(logits[greedy[n]] - logits[theirs[n]]):.3f}")
        assert float(logits[greedy[n]] - logits[theirs[n]]) > 1e-2


def test_mlx_vlm_peer_is_skipped_with_its_reason_where_it_cannot_run(tmp_path):
    """A family whose hidden states mlx-vlm's speculative loop does not capture (Llama): the eval goes on
    without the peer, which names mlx-vlm's reason in one line."""
    pytest.importorskip("mlx_vlm")
    from test_families import public_drafter_config

    from specdec.drafting.dflash.config import save_checkpoint
    from specdec.drafting.dflash.torch import DFlashConfig, DFlashDraftModel
    from specdec.evals.peers import VLM, peer_runners
    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(tinymodels.tiny_tokenizer(tinymodels.tiny_llama(tmp_path / "llama")))
    cfg = DFlashConfig.from_dict(public_drafter_config("qwen3", v.num_layers))
    save_checkpoint(tmp_path / "d", cfg, DFlashDraftModel(cfg).state_dict())
    runners, notes = peer_runners(v, DecodeConfig(max_new_tokens=8, block_size=4),
                                  load_drafter(str(tmp_path / "d"), verifier=v))  # fmt: skip
    assert VLM not in runners and notes[VLM].startswith("skipped: mlx-vlm 0.7.10 cannot run it here (")
    assert "\n" not in notes[VLM]
