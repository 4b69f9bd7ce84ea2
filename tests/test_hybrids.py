"""The models most public DFlash drafters target: Qwen3.5 (dense, MoE) and Qwen3-Next, Gated DeltaNet
hybrids, and gpt-oss (attention sinks, alternating sliding windows, MoE), on both verifiers.

Tiny random folders from tests/tinymodels.py, fp32, sharpened heads, saved by transformers in the layouts
real checkpoints have (Qwen3.5 as `Qwen3_5ForConditionalGeneration` with a vision tower), loaded by
transformers and mlx_lm. Prompts are 40 tokens, so gpt-oss's windows of 16 have wrapped. References are
each runtime's own greedy generation. A rollback of a recurrent layer must give back exactly the state
after the accepted prefix: the HF verifier keeps one recurrent state per verified position (transformers'
own recording), the MLX verifier replays the recurrence over the accepted prefix from the state before
the verify (`specdec.verifiers.mlx_cache.Recurrent`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from drafters import RandomDrafter, ScriptedDrafter, check_acceptance

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
transformers = pytest.importorskip("transformers")

import parity  # noqa: E402
import tinymodels  # noqa: E402
from measured import exact_or_measured_not  # noqa: E402

from specdec.drafting.dflash.config import save_checkpoint  # noqa: E402
from specdec.drafting.dflash.torch import DFlashConfig, DFlashDrafter, DFlashDraftModel  # noqa: E402
from specdec.drafting.lookup.prompt import PromptLookupDrafter  # noqa: E402
from specdec.engine import DecodeConfig, generate  # noqa: E402
from specdec.protocols import RollbackError  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.stream import StreamingEngine  # noqa: E402
from specdec.verifiers.hf import HFVerifier  # noqa: E402
from specdec.verifiers.mlx import MLXVerifier  # noqa: E402

pytestmark = [pytest.mark.mlx, pytest.mark.hf]

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss")
GDN = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # the hybrids with recurrent layers
RUNTIMES = ("hf", "mlx")
PLEN, N_NEW = 40, 32
PROMPT = [(7 * i) % 300 + 5 for i in range(PLEN)]
KW = dict(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrids")
    out = {
        "qwen3_5": tinymodels.tiny_qwen3_5(root / "qwen3_5"),
        "qwen3_5_moe": tinymodels.tiny_qwen3_5(root / "qwen3_5_moe", moe=True),
        "qwen3_next": tinymodels.tiny_qwen3_next(root / "qwen3_next"),
        "gpt_oss": tinymodels.tiny_gpt_oss(root / "gpt_oss"),
    }
    for p in out.values():
        tinymodels.tiny_tokenizer(p)
    return out


@pytest.fixture(scope="module")
def verifiers(paths) -> dict[tuple[str, str], HFVerifier | MLXVerifier]:
    return {
        (rt, a): (HFVerifier if rt == "hf" else MLXVerifier)(p) for a, p in paths.items() for rt in RUNTIMES
    }


@pytest.fixture(scope="module")
def refs(verifiers) -> dict[tuple[str, str], list[int]]:
    """Each runtime's own greedy continuation of PROMPT."""
    return {
        (rt, a): parity.runtime_generate(v.model, PROMPT, N_NEW)
        if rt == "hf"
        else parity.mlx_lm_greedy(v, PROMPT, N_NEW)
        for (rt, a), v in verifiers.items()
    }


def run(v, drafter=None, *, n: int = N_NEW, prompt=PROMPT, **kw) -> list[int]:
    cfg = DecodeConfig(max_new_tokens=n, block_size=8 if drafter else 1, stop_token_ids=frozenset(), **kw)
    return generate(v, prompt, drafter=drafter, cfg=cfg).output_tokens


# ---- loading ---------------------------------------------------------------------------------------------


def test_caches_and_loading(verifiers, paths, tmp_path):
    """Recurrent layers get transformers' linear-attention layer / mlx_lm's ArraysCache, gpt-oss's sliding
    layers a sliding-window layer / a plain KVCache (window from the mask); every model can roll back."""
    names = {a: [type(la).__name__ for la in verifiers["hf", a]._cache.layers] for a in ARCHS}
    assert names["qwen3_5"] == (["LinearAttentionLayer"] * 3 + ["GrowingLayer"]) * 2
    assert names["gpt_oss"] == ["DynamicSlidingWindowLayer", "GrowingLayer"] * 2
    for a in ARCHS:
        mv = verifiers["mlx", a]
        kinds = [type(c).__name__ for c in mv._cache]
        assert kinds == (["ArraysCache"] * 3 + ["KVCache"]) * 2 if a in GDN else kinds == ["KVCache"] * 4
        assert sorted(mv._recurrent) == ([0, 1, 2, 4, 5, 6] if a in GDN else [])
        assert not mv.run_ahead if a in GDN else mv.run_ahead
        for rt in RUNTIMES:
            verifiers[rt, a].check_rollback()
    # transformers' text-only Qwen3.5 layout loads in mlx_lm too (as the text model of the multimodal one)
    text = tinymodels.tiny_qwen3_5(tmp_path / "text", multimodal=False)
    hv, mv = HFVerifier(text), MLXVerifier(text)
    assert mv.model_type == "qwen3_5_text" and hv.config.model_type == "qwen3_5_text"
    assert run(hv, n=8) == run(mv, n=8)


@pytest.mark.parametrize("arch", ARCHS)
def test_mlx_community_conversions_load(paths, verifiers, tmp_path, arch):
    """A model as mlx_lm's convert writes it (sanitized weights: what mlx-community repos hold), in fp32
    and 4-bit, loads unchanged by our layout fixes; the 4-bit one (quantized input projections in every
    recurrent mixer) decodes speculatively exactly as it does autoregressively."""
    import shutil

    from mlx_lm.utils import quantize_model, save_config, save_model

    v = verifiers["mlx", arch]
    for bits in (None, 4):
        fresh = MLXVerifier(paths[arch])  # its own copy: quantize_model changes the model in place
        model, config = fresh.model, fresh.config
        if bits:
            model, config = quantize_model(model, config, group_size=32, bits=bits)
        out = tmp_path / f"converted{bits}"
        save_model(out, model)
        save_config(config, out / "config.json")
        shutil.copy(paths[arch] / "generation_config.json", out)
        c = MLXVerifier(out)
        if not bits:
            assert run(c) == run(v)
            continue
        ar = run(c)
        for drafter in (
            RandomDrafter(seed=2, vocab=c.vocab_size, block_size=8),
            PromptLookupDrafter(block_size=8),
        ):
            assert run(c, drafter) == ar


@pytest.mark.parametrize("arch", ARCHS)
def test_runtimes_agree(verifiers, arch):
    """Both runtimes load the same model: logits and features of one prefill, fp32. mlx_lm's YaRN RoPE
    (gpt-oss) rounds its correction range where transformers' does not (`truncate: false`): a small
    difference of mlx_lm's model, not of our verifier."""
    hv, mv = verifiers["hf", arch], verifiers["mlx", arch]
    out = []
    for v in (hv, mv):
        v.set_target_layers((0, v.num_layers - 1))
        v.reset()
        out.append(
            torch.as_tensor(np.array(v._forward(PROMPT, last_only=False))) if v is mv else v.forward(PROMPT)
        )
        out.append(v.features(PLEN, **KW))
        v.set_target_layers(())
        v.reset()
    tol = 2e-3 if arch == "gpt_oss" else 1e-4
    torch.testing.assert_close(out[2], out[0], atol=tol, rtol=tol)
    torch.testing.assert_close(out[3], out[1], atol=tol, rtol=tol)


# ---- exactness -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rt", RUNTIMES)
def test_ar_is_the_runtimes_own_greedy(verifiers, refs, rt, arch):
    assert run(verifiers[rt, arch]) == refs[rt, arch]


class GappyDrafter(ScriptedDrafter):
    """Proposes nothing every third step: a verify of the last token alone between drafted ones (a
    recurrent state left stale by such a step would show, vLLM #52942)."""

    def propose(self, last_token: int, n: int) -> list[int]:
        self.calls = getattr(self, "calls", 0) + 1
        return [] if self.calls % 3 == 0 else super().propose(last_token, n)


def make_drafter(kind: str, v, ref: list[int], tmp_path: Path):
    kw = dict(
        vocab=v.vocab_size, block_size=8, target_layer_ids=(1, v.num_layers - 1), hidden_size=v.hidden_size
    )
    if kind == "all":
        return ScriptedDrafter(PROMPT + ref, **kw)
    if kind == "none":
        return RandomDrafter(seed=3, **kw)
    if kind == "part":
        return ScriptedDrafter(PROMPT + ref, wrong_at={PLEN + i for i in (1, 2, 6, 13, 14, 15, 22)}, **kw)
    if kind == "gappy":
        return GappyDrafter(PROMPT + ref, wrong_at={PLEN + i for i in (3, 11, 12)}, **kw)
    if kind == "lookup":
        return PromptLookupDrafter(block_size=8)
    cfg = DFlashConfig(  # a random DFlash drafter: nearly every draft rejected, the largest rollbacks
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=v.vocab_size, num_target_layers=v.num_layers, mask_token_id=3,
        block_size=8, target_layer_ids=(1, v.num_layers - 2),
    )  # fmt: skip
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "dflash", cfg, DFlashDraftModel(cfg).state_dict())
    drafter = DFlashDrafter.from_pretrained(tmp_path / "dflash")
    drafter.bind(v)
    return drafter


@pytest.mark.parametrize("kind", ["all", "none", "part", "gappy", "lookup", "dflash"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rt", RUNTIMES)
def test_speculative_equals_autoregressive(verifiers, refs, tmp_path, rt, arch, kind):
    v, ref = verifiers[rt, arch], refs[rt, arch]
    drafter = make_drafter(kind, v, ref, tmp_path)
    cfg = DecodeConfig(max_new_tokens=N_NEW, block_size=8, stop_token_ids=frozenset())
    res = generate(v, PROMPT, drafter=drafter, cfg=cfg)
    assert res.output_tokens == ref
    check_acceptance(res.decode_steps, kind)
    if kind in ("all", "part", "gappy"):  # the drafter got the committed positions' features
        full = torch.cat(drafter.features)
        v.set_target_layers(drafter.target_layer_ids)
        v.reset()
        v.prefill((PROMPT + ref)[: full.shape[0]])
        torch.testing.assert_close(full, v.features(full.shape[0], **KW), atol=1e-4, rtol=1e-4)
        v.set_target_layers(())


def _states(v) -> list[torch.Tensor]:
    """Every recurrent layer's conv window and state, as they stand."""
    if v.runtime == "mlx":
        return [torch.tensor(np.array(a)) for i in sorted(v._recurrent) for a in v._cache[i].cache]
    return [
        t.clone()
        for la in v._linear
        for t in (la.conv_states[0][..., -la.conv_kernel_size[0] :], la.recurrent_states[0])
    ]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("arch", GDN)
@pytest.mark.parametrize("rt", RUNTIMES)
def test_verify_equals_one_token_steps_on_the_recurrent_layers(verifiers, rt, arch):
    """A verify of 8 runs the recurrence token by token: bit for bit the states 8 one-token steps reach.
    mlx-cpu: every layer (the whole model is batch-invariant here). HF fp32: the first layer (fp32
    attention and MoE experts round by row count, so later layers see other inputs); bf16 below."""
    v, block = verifiers[rt, arch], PROMPT[:8]
    got = []
    for calls in ([block], [[t] for t in block]):
        v.reset()
        v.prefill(PROMPT)
        for c in calls:
            v.verify(c)
        v.rollback(0)
        got.append(_states(v))
    v.reset()
    n = len(got[0]) if rt == "mlx" else 2  # HF: layer 0's conv window and state
    assert _equal(got[0][:n], got[1][:n])
    if rt == "mlx":
        assert v.batch_invariant


@pytest.mark.parametrize("arch", GDN)
@pytest.mark.parametrize("rt", RUNTIMES)
def test_rollback_restores_the_state_after_the_accepted_prefix(verifiers, rt, arch):
    v, block = verifiers[rt, arch], PROMPT[5:13]
    v.reset()
    v.prefill(PROMPT)
    before = _states(v) if rt == "mlx" else None
    first = v.verify(block)
    v.rollback(len(block))  # the whole block
    if rt == "mlx":
        assert _equal(_states(v), before)
    assert v.verify(block) == first and v.position == PLEN + 8
    v.rollback(0)  # none
    after = _states(v)
    v.verify([7])
    v.rollback(1)
    assert _equal(_states(v), after)
    for keep in (5, 1):  # part: the state a verify of the accepted prefix alone reaches
        v.reset()
        v.prefill(PROMPT)
        v.verify(block)
        v.rollback(8 - keep)
        rolled = _states(v)
        v.reset()
        v.prefill(PROMPT)
        v.verify(block[:keep])
        v.rollback(0)
        fresh = _states(v)
        if rt == "mlx":
            assert _equal(rolled, fresh)
        else:  # the prefix's own gates are computed over fewer rows: rounding apart
            for x, y in zip(rolled, fresh):
                torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    v.reset()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rt", RUNTIMES)
def test_random_partial_rollbacks_equal_a_fresh_forward(verifiers, rt, arch):
    """Ten verifies of random blocks, each rolled back to a random length (none to all): the cache then
    answers as a cache-free forward over what was kept, past gpt-oss's sliding windows (16) too."""
    v = verifiers[rt, arch]
    v.reset()
    kept = list(PROMPT)
    v.prefill(kept)
    rng = np.random.default_rng(1)
    for _ in range(10):
        block = rng.integers(5, v.vocab_size, 8).tolist()
        v.verify(block)
        n = int(rng.integers(0, 9))
        v.rollback(n)
        kept += block[: 8 - n]
    probe = [9, 10, 11]
    if rt == "hf":
        cached = v.forward(probe)
        with torch.inference_mode():
            fresh = v.model(torch.tensor([kept + probe])).logits[0, -3:]
    else:
        cached = torch.tensor(np.array(v._forward(probe, last_only=False)))
        fresh = torch.tensor(np.array(v.model(mx.array(kept + probe)[None])[0, -3:]))
    v.reset()
    assert len(kept) > PLEN + 16
    torch.testing.assert_close(cached, fresh, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("rt", RUNTIMES)
def test_a_rollback_reaches_only_what_was_recorded(verifiers, rt):
    """A prefill longer than MAX_VERIFY_TOKENS keeps no per-position state: reaching into it is refused with
    the reason (callers that can, like prefix reuse, then prefill again); the cache is left as it was."""
    v = verifiers[rt, "qwen3_5"]
    v.reset()
    v.prefill(PROMPT * 2)  # 80 > 64
    with pytest.raises(RollbackError, match=r"recurrent state|undo the last 0 positions"):
        v.rollback(1)
    assert v.position == 2 * PLEN
    v.verify([5, 6, 7])
    with pytest.raises(RollbackError):
        v.rollback(4)
    v.rollback(3)
    assert v.position == 2 * PLEN
    v.reset()


# ---- public drafters for these targets -------------------------------------------------------------------


def public_drafter_config(arch: str, num_target_layers: int) -> dict:
    """config.json in the public DFlash format (the fields z-lab's drafters carry; tiny widths): default
    target layers; "qwen3_6" with YaRN RoPE (z-lab/dflash "Fix Qwen3.6 Rope") and sliding-window drafter
    layers; "gpt_oss" with explicit target layer ids, one repeated."""
    base = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
        "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e7, "rope_scaling": None,
        "max_position_embeddings": 262144,
        "vocab_size": 320, "num_target_layers": num_target_layers, "block_size": 16, "attention_bias": False,
        "dflash_config": {"mask_token_id": 319},
    }  # fmt: skip
    if arch == "qwen3_6":
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
        types = ["sliding_attention"] * 4 + ["full_attention"]
        return {**base, "rope_scaling": yarn, "layer_types": types, "sliding_window": 24}
    if arch == "gpt_oss":
        return {**base, "dflash_config": {"mask_token_id": 319, "target_layer_ids": [0, 1, 1, 2, 2, 3]}}
    return base


@pytest.mark.parametrize("style", ["qwen3_5", "qwen3_6"])
@pytest.mark.parametrize(("rt", "drafter_rt"), [("hf", "torch"), ("mlx", "torch"), ("mlx", "mlx")])
def test_public_drafter_configs_load_bind_and_decode_exactly(
    verifiers, refs, tmp_path, rt, drafter_rt, style
):
    from specdec.drafting.dflash.mlx import MLXDFlashDrafter

    arch = "qwen3_5"
    v = verifiers[rt, arch]
    cfg = DFlashConfig.from_dict(public_drafter_config(style, v.num_layers))
    assert cfg.target_layer_ids == (1, 2, 3, 4, 5)  # z-lab's default spread over 8 layers
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "d", cfg, DFlashDraftModel(cfg).state_dict())
    drafter = (DFlashDrafter if drafter_rt == "torch" else MLXDFlashDrafter).from_pretrained(tmp_path / "d")
    drafter.bind(v)
    cfg_run = DecodeConfig(max_new_tokens=N_NEW, block_size=16, stop_token_ids=frozenset())
    assert generate(v, PROMPT, drafter=drafter, cfg=cfg_run).output_tokens == refs[rt, arch]


def test_gpt_oss_drafter_config(verifiers, refs, tmp_path):
    v = verifiers["hf", "gpt_oss"]
    cfg = DFlashConfig.from_dict(public_drafter_config("gpt_oss", v.num_layers))
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "d", cfg, DFlashDraftModel(cfg).state_dict())
    drafter = DFlashDrafter.from_pretrained(tmp_path / "d")
    drafter.bind(v)
    assert drafter.target_layer_ids == (0, 1, 1, 2, 2, 3)
    cfg_run = DecodeConfig(max_new_tokens=N_NEW, block_size=16, stop_token_ids=frozenset())
    assert generate(v, PROMPT, drafter=drafter, cfg=cfg_run).output_tokens == refs["hf", "gpt_oss"]


# ---- the rest of the engine ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rt", RUNTIMES)
def test_multi_turn_reuse_edits_stops_and_cancel(verifiers, rt, arch):
    """Prefix reuse (a continued and an edited history), a stop string inside an accepted block, and a
    cancelled run each leave caches that the next run continues exactly as a fresh run would."""
    v = verifiers[rt, arch]
    engine = StreamingEngine(v, PromptLookupDrafter(block_size=8))

    def fresh(ids: list[int], n: int) -> list[int]:
        return run(v, PromptLookupDrafter(block_size=8), prompt=ids, n=n)

    ids = PROMPT[:30]
    r1 = engine.complete(ids, max_tokens=20, stop_token_ids=frozenset())
    ids2 = [*ids, *r1.output_tokens, *PROMPT[30:36]]
    r2 = engine.complete(ids2, max_tokens=20, stop_token_ids=frozenset())
    assert r2.reused_tokens == len(ids) + len(r1.output_tokens) - 1
    assert r2.output_tokens == fresh(ids2, 20)
    ids3 = [*ids[:10], *PROMPT[20:30]]  # an edited history: a rollback the recurrent layers cannot reach
    r3 = engine.complete(ids3, max_tokens=20, stop_token_ids=frozenset())
    assert r3.output_tokens == fresh(ids3, 20)
    # a stop string inside a block: the stop cut rolls the caches back (or forgets them), never wrongly
    full = fresh(ids3, 24)
    stop = v.tokenizer.decode(full[9:11])
    r4 = engine.complete(ids3, max_tokens=24, stop=[stop], stop_token_ids=frozenset())
    assert r4.finish_reason == "stop" and r4.output_tokens == full[: len(r4.output_tokens)]
    assert engine.cached_tokens is None or engine.cached_tokens == [*ids3, *r4.output_tokens[:-1]]
    r5 = engine.complete(ids2, max_tokens=20, stop_token_ids=frozenset())
    assert r5.output_tokens == r2.output_tokens
    stream = engine.stream(ids3, max_tokens=200, stop_token_ids=frozenset())
    next(stream)
    threading.Thread(target=stream.cancel).start()
    list(stream)
    assert stream.result.finish_reason in ("cancelled", "length")
    assert engine.complete(ids2, max_tokens=20, stop_token_ids=frozenset()).output_tokens == r2.output_tokens


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rt", RUNTIMES)
def test_sampled_match_rule_equals_ar_with_the_same_seed(verifiers, refs, rt, arch):
    v = verifiers[rt, arch]
    for seed in range(3):
        sp = SamplingParams(temperature=1.0, seed=seed)
        ar = run(v, n=16, sampling=sp)
        drafter = ScriptedDrafter(PROMPT + ar, vocab=v.vocab_size, block_size=8, wrong_at={PLEN + 5})
        assert run(v, drafter, n=16, sampling=sp) == ar


@pytest.mark.parametrize("rt", RUNTIMES)
def test_long_runs_keep_the_recurrent_state_bounded(verifiers, refs, rt):
    """What a verify records for its rollback is let go by the next rollback: after 96 tokens of
    speculative decoding each recurrent layer holds its window and one state, nothing more."""
    v = verifiers[rt, "qwen3_next"]
    run(v, RandomDrafter(seed=1, vocab=v.vocab_size, block_size=8), n=96)
    if rt == "hf":
        for la in v._linear:
            assert la.conv_states[0].shape[-1] == la.conv_kernel_size[0]
            assert la.recurrent_states_history[0] == []
    else:
        for i in v._recurrent:
            conv, state = v._cache[i].cache
            assert conv.shape[1] == 3 and state.ndim == 4


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_bf16_is_batch_invariant_and_exact(paths, arch):
    """In bf16 the HF verifier measures batch invariance on the loaded hybrid (every recurrent layer
    included; gpt-oss's sinks in specdec's attention, which transformers runs eagerly) and, where it
    holds, speculation keeps autoregressive output bit for bit; the greedy text is transformers' own bf16
    `generate` up to its near-ties."""
    v = HFVerifier(paths[arch], dtype=torch.bfloat16)
    if not exact_or_measured_not(v):  # measured by the test too: bf16 speculation cannot be exact here
        return
    ar = run(v)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(paths[arch], dtype=torch.bfloat16).eval()
    ref = parity.runtime_generate(theirs, PROMPT, N_NEW)  # transformers' own attention
    exact = transformers.AutoModelForCausalLM.from_pretrained(paths[arch], dtype=torch.float32).eval()
    parity.assert_same_text_up_to_ties(ar, ref, theirs, PROMPT, exact=exact, tie=0.07, agree=4)
    for kind in ("none", "part"):
        assert run(v, make_drafter(kind, v, ar, Path("unused"))) == ar, kind


@pytest.mark.parametrize("rt", RUNTIMES)
def test_cli_and_server(paths, verifiers, capsys, rt):
    """The CLI runs a hybrid folder with a drafter; the server streams the same text the Python API does."""
    import json

    from starlette.testclient import TestClient

    from specdec.cli import main
    from specdec.serve.app import build_app

    argv = ["generate", "--verifier", rt, "--model", str(paths["qwen3_5"]), "--drafter", "prompt-lookup",
            "--prompt", "abc abc abc", "--max-new-tokens", "12", "--dtype", "float32"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    v = verifiers[rt, "qwen3_next"]
    msgs = [{"role": "user", "content": "abc abc"}]
    want = StreamingEngine(v, PromptLookupDrafter(block_size=8)).complete(msgs, max_tokens=16).text
    app = build_app(StreamingEngine(v, PromptLookupDrafter(block_size=8)), model_name="tiny")
    with TestClient(app) as client:
        body = {"model": "tiny", "messages": msgs, "max_tokens": 16, "stream": True}
        lines = client.post("/v1/chat/completions", json=body).text.splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want


# ---- what we still cannot run ----------------------------------------------------------------------------


def test_other_recurrent_layers_are_refused_with_the_reason(tmp_path, capsys):
    """LFM2's short-convolution layers: the HF verifier refuses the folder before the weights load; the
    MLX verifier runs it without a drafter and refuses speculation (its ArraysCache has no replay)."""
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        "lfm2", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1, 3], max_position_embeddings=1024,
        block_dim=64,  # real LFM2 configs carry it; mlx_lm needs it
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "lfm2")
    with pytest.raises(
        ValueError, match=r"layer types \['conv'\] whose state the HF verifier cannot roll back"
    ):
        HFVerifier(tmp_path / "lfm2")
    from specdec.cli import main

    capsys.readouterr()
    assert main(["generate", "--verifier", "hf", "--model", str(tmp_path / "lfm2"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot roll back" in err[0], err
    mv = MLXVerifier(tmp_path / "lfm2")
    assert len(run(mv, n=4)) == 4
    with pytest.raises(RuntimeError, match=r"cache types \['ArraysCache'\] for its layer types \['conv'\]"):
        generate(mv, PROMPT[:8], drafter=PromptLookupDrafter(block_size=4),
                 cfg=DecodeConfig(max_new_tokens=4, block_size=4))  # fmt: skip


def test_hf_refuses_a_transformers_without_linear_attention_recording(paths, monkeypatch):
    """A transformers release whose cache cannot keep linear-attention states (e.g. 5.17: no
    `recurrent_states_to_keep`) gets one line naming its version, never a TypeError from inside."""
    from transformers import DynamicCache

    def old(self):  # the 5.17 signature: no keyword arguments
        for la in self.layers:
            if hasattr(la, "activate_past_recording"):
                la.activate_past_recording()

    monkeypatch.setattr(DynamicCache, "activate_past_recording", old)
    with pytest.raises(RuntimeError, match=r"^transformers \S+ cannot keep the recurrent states") as e:
        HFVerifier(paths["qwen3_next"])
    assert "\n" not in str(e.value)
