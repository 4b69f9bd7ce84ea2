"""Gemma 4 (dense, MoE, unified) and Qwen3 (dense, MoE) on both verifiers (hybrids: tests/test_hybrids.py).

Tiny random folders from tests/tinymodels.py, fp32, loaded by transformers and mlx_lm alike. Gemma 4 dense
has per-layer inputs and 2 KV-shared layers (no cache entry of their own), Gemma 4 MoE has the MoE block
and K=V full layers, Gemma 4 unified (the 12B's family) neither per-layer inputs nor MoE and is saved as
a multimodal checkpoint, as real ones are; all mix sliding (window 16) and full attention and soft-cap at
30. Multimodal Gemma 3 / 4 checkpoints run their language model alone (tested against the whole
model's own generation). Prompts are 40
tokens, so every sliding window has wrapped before the first draft is verified. References are each
runtime's own greedy generation: transformers' `generate(do_sample=False)`, mlx_lm's `generate_step`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from drafters import RandomDrafter, ScriptedDrafter, check_acceptance, greedy_reference

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
transformers = pytest.importorskip("transformers")

import parity  # noqa: E402
import tinymodels  # noqa: E402

from specdec.bridges.mlx import text_model  # noqa: E402
from specdec.compat import config_fixes  # noqa: E402
from specdec.drafting.dflash.config import save_checkpoint  # noqa: E402
from specdec.drafting.dflash.torch import DFlashConfig, DFlashDrafter, DFlashDraftModel  # noqa: E402
from specdec.engine import DecodeConfig, generate  # noqa: E402
from specdec.verifiers.hf import HFVerifier  # noqa: E402
from specdec.verifiers.mlx import MLXVerifier  # noqa: E402

pytestmark = [pytest.mark.mlx, pytest.mark.hf]

FAMILIES = ("gemma4", "gemma4_moe", "gemma4_unified", "qwen3", "qwen3_moe")
GEMMAS = ("gemma4", "gemma4_moe", "gemma4_unified")
RUNTIMES = ("hf", "mlx")
PLEN, N_NEW, WINDOW = 40, 32, 16
PROMPT = [(7 * i) % 300 + 3 for i in range(PLEN)]
KW = dict(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {
        "gemma4": tinymodels.tiny_gemma4(root / "gemma4", sliding_window=WINDOW),
        "gemma4_moe": tinymodels.tiny_gemma4(root / "gemma4_moe", sliding_window=WINDOW, moe=True),
        "gemma4_unified": tinymodels.tiny_gemma4_unified(root / "gemma4_unified", sliding_window=WINDOW),
        "qwen3": tinymodels.tiny_qwen3(root / "qwen3"),
        "qwen3_moe": tinymodels.tiny_qwen3(root / "qwen3_moe", moe=True),
    }


@pytest.fixture(scope="module")
def verifiers(paths) -> dict[tuple[str, str], HFVerifier | MLXVerifier]:
    out: dict = {}
    for fam, p in paths.items():
        out["hf", fam], out["mlx", fam] = HFVerifier(p), MLXVerifier(p)
    return out


@pytest.fixture(scope="module")
def refs(verifiers) -> dict[tuple[str, str], list[int]]:
    out = {}
    for (rt, fam), v in verifiers.items():
        out[rt, fam] = (
            parity.runtime_generate(v.model, PROMPT, N_NEW)
            if rt == "hf"
            else parity.mlx_lm_greedy(v, PROMPT, N_NEW)
        )
        assert len(out[rt, fam]) == N_NEW
    return out


# ---- loading and caches ----------------------------------------------------------------------------------


def test_family_caches(verifiers):
    # HF: KV-shared Gemma 4 layers get a DummyLayer; sliding layers a sliding-window layer
    names = [type(la).__name__ for la in verifiers["hf", "gemma4"]._cache.layers]
    s, f = "DynamicSlidingWindowLayer", "GrowingLayer"
    assert names == [s, s, f, s, "DummyLayer", "DummyLayer"]
    # MLX: one cache per non-shared layer, all plain KVCache (window applied by the mask)
    mv = verifiers["mlx", "gemma4"]
    assert (mv.model_type, mv.num_layers, len(mv._cache)) == ("gemma4_text", 6, 4)
    assert verifiers["mlx", "gemma4_moe"].model_type == "gemma4_text"
    for (rt, fam), v in verifiers.items():
        v.check_rollback()
        if rt == "mlx":
            assert {type(c).__name__ for c in v._cache} == {"KVCache"}, fam
        assert (v.vocab_size, v.hidden_size, v.dtype) == (320, 64, "float32"), (rt, fam)
    assert verifiers["mlx", "qwen3_moe"].model_type == "qwen3_moe"


def test_mlx_qwen3_with_a_sliding_window_holds_one_window(verifiers):
    """mlx_lm's qwen3 / qwen3_moe never apply `sliding_window`: with `use_sliding_window` on they are the
    real model only within one window, so that is all the verifier may hold (as for gemma2)."""
    for fam in ("qwen3", "qwen3_moe"):
        v = verifiers["mlx", fam]
        cfg = {**v.config, "use_sliding_window": True, "sliding_window": 24}
        assert MLXVerifier.from_model(v.model, cfg).max_context == 24
        assert MLXVerifier.from_model(v.model, {**cfg, "use_sliding_window": False}).max_context == 1024


def test_config_fixes_for_new_families():
    g4 = {
        "model_type": "gemma4_text",
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "per_layer_config": {"1": {"head_dim": 32, "num_key_value_heads": 2}, "3": {"head_dim": 32}},
    }
    fixes = config_fixes(g4)
    assert (fixes["global_head_dim"], fixes["num_global_key_value_heads"]) == (32, 2)
    wrapped = config_fixes({"model_type": "gemma4", "text_config": g4})
    assert (
        wrapped["text_config"]["global_head_dim"] == 32
        and wrapped["text_config"]["model_type"] == "gemma4_text"
    )
    # transformers 5.25 pads the keys of a model of 10+ layers to one width: "05" is layer 5
    twelve = {**g4, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2,
              "per_layer_config": {"05": {"head_dim": 512}, "11": {"head_dim": 512}}}  # fmt: skip
    assert config_fixes(twelve)["global_head_dim"] == 512
    bad = {**g4, "per_layer_config": {"1": {"head_dim": 32}, "3": {"head_dim": 64}}}
    with pytest.raises(ValueError, match="disagree on head_dim"):
        config_fixes(bad)
    assert config_fixes({"num_local_experts": 4, "rope_theta": 1.0}) == {"num_experts": 4}
    nxt = {"model_type": "qwen3_next", "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    assert config_fixes(nxt) == {"full_attention_interval": 4}
    # a top-level rope_theta does not hide the rest of rope_parameters (gpt-oss's YaRN was lost so)
    yarn = {"rope_type": "yarn", "factor": 32.0, "rope_theta": 150000.0, "truncate": False}
    got = config_fixes({"model_type": "gpt_oss", "rope_theta": 150000.0, "rope_parameters": yarn})
    assert got == {"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "truncate": False}}
    rope = {"rope_theta": 1e7, "partial_rotary_factor": 0.25}
    assert config_fixes({**nxt, "rope_theta": 1e7, "rope_parameters": rope})["partial_rotary_factor"] == 0.25
    # Qwen3.5: the multimodal config gets its fixes inside text_config; the text-only one becomes one
    text = {**nxt, "model_type": "qwen3_5_text", "rope_parameters": rope}
    inner = config_fixes({"model_type": "qwen3_5", "text_config": text})["text_config"]
    assert inner["full_attention_interval"] == 4 and inner["model_type"] == "qwen3_5_text"
    outer = config_fixes(text)
    assert outer["model_type"] == "qwen3_5" and outer["text_config"]["rope_theta"] == 1e7
    # Gemma 4 unified is mlx_lm's Gemma 4 with per-layer inputs off (its default width is 256); a
    # multimodal Gemma keeps its text vocabulary (mlx_lm would put its own default of 262144+ there)
    unified = {**g4, "model_type": "gemma4_unified_text", "vocab_size": 320}
    fixes = config_fixes(unified)
    assert fixes["model_type"] == "gemma4_text" and fixes["hidden_size_per_layer_input"] == 0
    assert fixes["global_head_dim"] == 32
    wrapped = config_fixes({"model_type": "gemma4_unified", "text_config": unified})
    assert wrapped["vocab_size"] == 320 and wrapped["text_config"]["model_type"] == "gemma4_text"


# ---- cross-runtime: logits and features ------------------------------------------------------------------


@pytest.mark.parametrize("fam", FAMILIES)
def test_logits_and_features_match_across_runtimes(verifiers, fam):
    hv, mv = verifiers["hf", fam], verifiers["mlx", fam]
    L = hv.num_layers
    for v in (hv, mv):
        v.set_target_layers(range(L))  # every layer, the KV-shared ones included
        v.reset()
    assert hv.prefill(PROMPT) == mv.prefill(PROMPT)
    expect = hv.features(PLEN, **KW)  # [P, L*H]: all positions, also of the KV-shared layers
    assert expect.shape == (PLEN, L * 64)
    atol = 2e-5 * float(expect.abs().max().clamp(min=5.0))
    torch.testing.assert_close(mv.features(PLEN, **KW), expect, atol=atol, rtol=1e-4)
    # one verify past the window through the caches: logits and features again
    block = [5, 17, 250, 3, 99, 42, 7, 180]
    a = hv.forward(block)  # [8, V]
    b = torch.tensor(mv._forward(block, last_only=False).tolist())
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
    torch.testing.assert_close(mv.features(8, **KW), hv.features(8, **KW), atol=atol, rtol=1e-4)
    for v in (hv, mv):
        v.set_target_layers(())


def test_capture_is_bit_exact_with_tuple_layers(verifiers):
    """mlx_lm's Gemma 4 decoder layers return (h, kv, offset): the taps pass the tuple on untouched."""
    v = verifiers["mlx", "gemma4"]
    ids = mx.array(PROMPT)[None]
    ref = v.model(ids)
    v.set_target_layers(range(v.num_layers))
    store: dict = {}
    with v._tapped(store, last_only=False):
        tapped = v.model(ids)
    v.set_target_layers(())
    assert mx.array_equal(ref, tapped).item() and sorted(store) == list(range(v.num_layers))


# ---- greedy equivalence ----------------------------------------------------------------------------------


def make_drafter(kind: str, ref: list[int], v, bs: int = 8):
    kw = dict(
        vocab=v.vocab_size, block_size=bs, target_layer_ids=(1, v.num_layers - 1), hidden_size=v.hidden_size
    )
    if kind == "all":
        return ScriptedDrafter(PROMPT + ref, **kw)
    if kind == "none":
        return RandomDrafter(seed=3, **kw)
    return ScriptedDrafter(PROMPT + ref, wrong_at={PLEN + i for i in (1, 2, 6, 13, 14, 15, 22)}, **kw)


@pytest.mark.parametrize("kind", ["all", "none", "part"])
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("rt", RUNTIMES)
def test_greedy_equivalence(verifiers, refs, rt, fam, kind):
    v, ref = verifiers[rt, fam], refs[rt, fam]
    drafter = make_drafter(kind, ref, v)
    cfg = DecodeConfig(max_new_tokens=N_NEW, block_size=8, stop_token_ids=frozenset())
    res = generate(v, PROMPT, drafter=drafter, cfg=cfg)
    assert res.output_tokens == ref
    check_acceptance(res.decode_steps, kind)
    # the drafter got exactly the committed positions' features, equal to a one-shot prefill's
    full = torch.cat(drafter.features)  # [P + n, K*H]
    seq = PROMPT + ref
    assert drafter.tokens == seq[: full.shape[0]]
    v.set_target_layers(drafter.target_layer_ids)
    v.reset()
    v.prefill(seq[: full.shape[0]])
    expect = v.features(full.shape[0], **KW)
    # incremental vs one-shot kernels (a verify's few rows and a prefill's many run different fp32
    # products, see specdec.kernels): rounding noise relative to the activations (Gemma 4's reach ~30)
    torch.testing.assert_close(full, expect, atol=3e-5 * float(expect.abs().max().clamp(min=1.0)), rtol=1e-5)
    v.set_target_layers(())


@pytest.mark.parametrize("fam", ["llama", "gemma3", *FAMILIES])
def test_mlx_bf16_is_mlx_lms_own_bf16(paths, tmp_path, fam):
    """In bf16 the MLX verifier's greedy output is mlx_lm's own greedy output on the same bf16 weights
    (not only our AR's), up to mlx_lm's own ties: it takes the argmax of bf16 log-probabilities, whose
    rounding (~0.03 at these values) makes near-equal logits equal, and then the first id wins. Where
    the verify is batch-invariant (measured at load) speculation keeps our output."""
    path = paths.get(fam) or getattr(tinymodels, f"tiny_{fam}")(tmp_path / fam)
    v = MLXVerifier(path, dtype="bfloat16")
    try:
        ref = parity.mlx_lm_greedy(v, PROMPT, N_NEW)
    except RuntimeError as e:
        if "only supports float32" not in str(e):
            raise
        pytest.skip(f"needs Apple silicon: mlx-cpu's mlx_lm cannot run {fam} in bf16 either ({e})")
    cfg = DecodeConfig(max_new_tokens=N_NEW, block_size=1, stop_token_ids=frozenset())
    ours = generate(v, PROMPT, cfg=cfg).output_tokens
    n = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), N_NEW)
    if n < N_NEW:  # where we part, mlx_lm's own log-probabilities tie between its token and ours
        logits = v.model(mx.array(PROMPT + ref[:n])[None])[0, -1]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        assert logprobs[ours[n]].item() == logprobs[ref[n]].item(), (n, ours[n], ref[n])
    if v.batch_invariant:
        for kind in ("all", "none", "part"):
            res = generate(v, PROMPT, drafter=make_drafter(kind, ours, v), cfg=replace(cfg, block_size=8))
            assert res.output_tokens == ours, kind


# ---- rollback past the window ----------------------------------------------------------------------------


def _fresh_logits(v, seq: list[int]) -> torch.Tensor:
    """Logits [T, V] of a cache-free forward over `seq`."""
    if v.runtime == "hf":
        with torch.inference_mode():
            return v.model(torch.tensor([seq])).logits[0]
    return torch.tensor(v.model(mx.array(seq)[None])[0].tolist())


@pytest.mark.parametrize("fam", GEMMAS)
@pytest.mark.parametrize("rt", RUNTIMES)
def test_partial_rollbacks_past_the_window_match_full_recompute(verifiers, rt, fam):
    v = verifiers[rt, fam]
    v.set_target_layers(())
    v.reset()
    seq = list(PROMPT)
    v.prefill(seq)
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        block = torch.randint(0, v.vocab_size, (8,), generator=g).tolist()
        v.verify(block)
        keep = int(torch.randint(0, 9, (1,), generator=g))
        v.rollback(8 - keep)
        seq += block[:keep]
        assert v.position == len(seq)
    assert len(seq) > 2 * WINDOW
    probe = [5, 6, 7]
    cached = v.forward(probe) if rt == "hf" else torch.tensor(v._forward(probe, last_only=False).tolist())
    fresh = _fresh_logits(v, seq + probe)[-3:]
    torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)
    assert cached.argmax(-1).tolist() == fresh.argmax(-1).tolist()


# ---- embedding and head callbacks ------------------------------------------------------------------------


def _final_norm(v, h: torch.Tensor) -> torch.Tensor:
    if v.runtime == "hf":
        return v.model.model.norm(h)
    return torch.tensor(text_model(v.model).model.norm(mx.array(h.numpy())).tolist())


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("rt", RUNTIMES)
def test_embed_and_lm_head_reproduce_the_model(paths, verifiers, rt, fam):
    v = verifiers[rt, fam]
    from safetensors.torch import load_file

    weights = load_file(str(paths[fam] / "model.safetensors"))
    w = weights.get("model.embed_tokens.weight", weights.get("model.language_model.embed_tokens.weight"))
    seq = torch.tensor(PROMPT[:12])
    scale = 64**0.5 if fam in GEMMAS else 1.0  # Gemma: sqrt(hidden) in fp32 (no bf16 rounding in Gemma 4)
    torch.testing.assert_close(v.embed_fn(**KW)(seq), w[seq] * scale, rtol=1e-6, atol=1e-6)
    # head(final_norm(raw last-layer output)) == the model's logits (soft-capping included)
    v.set_target_layers((v.num_layers - 1,))
    v.reset()
    v.verify(PROMPT)
    logits = _fresh_logits(v, PROMPT)  # [P, V]
    head = v.lm_head_fn(**KW)
    torch.testing.assert_close(head(_final_norm(v, v.features(PLEN, **KW))), logits, rtol=1e-4, atol=1e-4)
    v.set_target_layers(())
    x = torch.randn(4, 64) * 100
    big = head(x)
    rows = torch.tensor([0, 5, 7, 100, 255])  # a draft vocabulary: the same logits, only these columns
    torch.testing.assert_close(v.lm_head_fn(**KW, rows=rows)(x), big[:, rows], rtol=1e-5, atol=1e-4)
    if fam in GEMMAS:
        assert 25.0 < big.abs().max() <= 30.0  # tanh soft-capping at 30
    else:
        assert big.abs().max() > 30.0


# ---- multimodal checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("fam", ["gemma3", "gemma4", "gemma4_unified"])
def test_multimodal_checkpoints_run_their_language_model(paths, tmp_path, fam):
    """Real Gemma 3 / 4 checkpoints are vision-language models (`...ForConditionalGeneration`, the
    language model under `model.language_model.*`), which transformers' AutoModelForCausalLM builds
    whole. Both verifiers load the language model alone (the towers unread) and give the whole model's
    own logits and greedy generation, speculatively too; the HF verifier given the loaded object runs its
    language model (shared, not copied)."""
    if fam == "gemma4_unified":
        path = paths[fam]
    else:
        kw = {"softcap": None} if fam == "gemma3" else {}  # as released: see tiny_gemma3
        text = getattr(tinymodels, f"tiny_{fam}")(tmp_path / "text", sliding_window=WINDOW, **kw)
        path = tinymodels.with_vision(tmp_path / "vision", text)
    whole = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(whole).__name__.endswith("ForConditionalGeneration")
    with torch.inference_mode():
        expect = whole(torch.tensor([PROMPT])).logits[0]  # [P, V]
    ref = parity.runtime_generate(whole, PROMPT, N_NEW)
    hv, mv = HFVerifier(path), MLXVerifier(path)
    assert type(hv.model).__name__.endswith("ForCausalLM")
    assert sum(p.numel() for p in hv.model.parameters()) < sum(p.numel() for p in whole.parameters())
    torch.testing.assert_close(_fresh_logits(hv, PROMPT), expect, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_fresh_logits(mv, PROMPT), expect, atol=1e-4, rtol=1e-4)
    ov = HFVerifier(whole)  # the loaded object, as an app holds it: its language model, shared
    assert type(ov.model).__name__ == type(hv.model).__name__ and ov.model.model is whole.model.language_model
    for v in (hv, mv, ov):
        drafter = make_drafter("part", ref, v)
        cfg = DecodeConfig(max_new_tokens=N_NEW, block_size=8, stop_token_ids=frozenset())
        assert generate(v, PROMPT, drafter=drafter, cfg=cfg).output_tokens == ref, v.runtime


# ---- public drafter configs ------------------------------------------------------------------------------


def public_drafter_config(fam: str, num_target_layers: int) -> dict:
    """A config.json in the public DFlash format, in the shape of the public drafters for the family
    (tiny widths: hidden size of the tiny targets)."""
    base = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096, "vocab_size": 320,
        "num_target_layers": num_target_layers, "block_size": 16, "attention_bias": False,
    }  # fmt: skip
    if fam in GEMMAS:  # gemma-4 drafters: 6 target features, 4 sliding + 1 full layers, window 2048
        return {
            **base, "num_hidden_layers": 5, "sliding_window": 2048, "final_logit_softcapping": 30.0,
            "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
            "dflash_config": {"mask_token_id": 4, "target_layer_ids": list(range(6))},
        }  # fmt: skip
    # Qwen3-8B-DFlash-b16: 5 layers, default target layers (1..L-3 evenly), no sliding window
    return {**base, "num_hidden_layers": 5, "dflash_config": {"mask_token_id": 319}}


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("rt", RUNTIMES)
def test_public_drafter_config_loads_binds_and_decodes_exactly(tmp_path, verifiers, refs, rt, fam):
    v = verifiers[rt, fam]
    cfg = DFlashConfig.from_dict(public_drafter_config(fam, v.num_layers))
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "drafter", cfg, DFlashDraftModel(cfg).state_dict())
    drafter = DFlashDrafter.from_pretrained(tmp_path / "drafter")
    if fam in GEMMAS:
        assert drafter.target_layer_ids == (0, 1, 2, 3, 4, 5) and drafter.feature_dim == 6 * 64
        assert drafter.cfg.layer_types.count("sliding_attention") == 4 and drafter.cfg.sliding_window == 2048
        assert drafter.cfg.extra["final_logit_softcapping"] == 30.0  # kept; the cap itself is the target's
    else:
        assert drafter.target_layer_ids == (1, 2, 3, 4, 5) and drafter.block_size == 16
    drafter.bind(v)
    res = generate(v, PROMPT, drafter=drafter, cfg=DecodeConfig(max_new_tokens=N_NEW, block_size=16,
                                                                stop_token_ids=frozenset()))  # fmt: skip
    assert res.output_tokens == refs[rt, fam]


def test_drafter_mismatches_fail_clearly(tmp_path, verifiers):
    from specdec.drafting.dflash.mlx import MLXDFlashDrafter

    g_cfg = DFlashConfig.from_dict(public_drafter_config("gemma4", 6))
    q_cfg = DFlashConfig.from_dict(public_drafter_config("qwen3", 8))
    save_checkpoint(tmp_path / "g", g_cfg, DFlashDraftModel(g_cfg).state_dict())
    with pytest.raises(ValueError, match=r"built for a target with 6 layers.*has 8"):  # the MLX runtime too
        MLXDFlashDrafter.from_pretrained(tmp_path / "g").bind(verifiers["mlx", "qwen3"])
    for rt in RUNTIMES:
        g, q = verifiers[rt, "gemma4"], verifiers[rt, "qwen3"]
        with pytest.raises(ValueError, match=r"built for a target with 6 layers.*has 8"):
            DFlashDrafter(DFlashDraftModel(g_cfg)).bind(q)
        bad_ids = DFlashConfig.from_dict({**public_drafter_config("qwen3", 8), "dflash_config": {
            "mask_token_id": 319, "target_layer_ids": [1, 3, 5, 7, 7]}})  # fmt: skip
        with pytest.raises(ValueError, match=r"asks for target layers \[7, 7\].*has layers 0\.\.5"):
            DFlashDrafter(DFlashDraftModel(bad_ids)).bind(g)
        wide = public_drafter_config("qwen3", 8) | {"hidden_size": 128}
        with pytest.raises(ValueError, match="expects features of width 640"):
            DFlashDrafter(DFlashDraftModel(DFlashConfig.from_dict(wide))).bind(q)
        with pytest.raises(ValueError, match="vocabulary size 262144"):
            DFlashDrafter(DFlashDraftModel(DFlashConfig(**{**vars_of(q_cfg), "vocab_size": 262144}))).bind(q)


def vars_of(cfg: DFlashConfig) -> dict:
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__ if k != "extra"}


# ---- transformers bug worked around ----------------------------------------------------------------------


def test_gemma4_kv_sharing_without_per_layer_inputs(tmp_path):
    """transformers up to 5.24: a Gemma 4 with KV-shared layers but no per-layer inputs fails in its own
    forward (`_maybe_slice_kv_shared_inputs` slices `per_layer_inputs=None`) whenever `logits_to_keep` is
    an int, so `model(ids)` and `generate` fail; 5.25 fixed it. HFVerifier passes position indices and
    works with either."""
    path = tinymodels.tiny_gemma4(tmp_path / "g4", sliding_window=WINDOW, moe=True, kv_shared=2)
    hv, mv = HFVerifier(path), MLXVerifier(path)
    try:
        with torch.inference_mode():
            hv.model(torch.tensor([PROMPT]))
    except TypeError as e:  # the bug, in the versions that have it
        assert "NoneType" in str(e)
    ref = parity.mlx_lm_greedy(mv, PROMPT, 16)
    assert greedy_reference(hv, PROMPT, 16) == ref
    for v in (hv, mv):
        drafter = ScriptedDrafter(PROMPT + ref, wrong_at={PLEN + 3}, vocab=320, block_size=6,
                                  target_layer_ids=(1, 5), hidden_size=64)  # fmt: skip
        cfg = DecodeConfig(max_new_tokens=16, block_size=6, stop_token_ids=frozenset())
        assert generate(v, PROMPT, drafter=drafter, cfg=cfg).output_tokens == ref
