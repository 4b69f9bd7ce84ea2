"""MLXVerifier against mlx_lm's own generation, a full-recompute reference, and transformers' hidden states.

Tiny random Llama / Gemma 3 folders (tests/tinymodels.py), fp32. Gemma 3's sliding window is 16 and the
prompts are 40 tokens, so the window has wrapped before the first draft is verified.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from drafters import RandomDrafter, ScriptedDrafter, greedy_reference

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytest.importorskip("transformers")  # tinymodels builds the folders with transformers

import parity  # noqa: E402
import tinymodels  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache, trim_prompt_cache  # noqa: E402

from specdec.compat import config_fixes  # noqa: E402
from specdec.engine import DecodeConfig, generate  # noqa: E402
from specdec.verifiers.mlx import MLXVerifier  # noqa: E402

pytestmark = pytest.mark.mlx

PLEN, N_NEW, WINDOW = 40, 40, 16
PROMPT = [(7 * i) % 300 + 3 for i in range(PLEN)]


def sharpen(path: Path, factor: float) -> Path:
    """Scale every matrix of a saved model: random-init logits are nearly flat (greedy near-ties and
    repetitive output); scaled ones give varied text with clear argmax margins."""
    f = path / "model.safetensors"
    w = mx.load(str(f))
    mx.save_safetensors(str(f), {k: v * factor if v.ndim == 2 else v for k, v in w.items()}, {"format": "pt"})
    return path


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx_models")
    return {
        "llama": sharpen(tinymodels.tiny_llama(root / "llama"), 20.0),
        "gemma3": tinymodels.tiny_gemma3(root / "gemma3", sliding_window=WINDOW),
    }


@pytest.fixture(scope="module")
def verifiers(paths) -> dict[str, MLXVerifier]:
    return {k: MLXVerifier(p) for k, p in paths.items()}


@pytest.fixture(scope="module")
def refs(verifiers) -> dict[str, list[int]]:
    out = {}
    for k, v in verifiers.items():
        own = parity.mlx_lm_greedy(v, PROMPT, N_NEW)
        slow = greedy_reference(v, PROMPT, N_NEW)
        assert own == slow, f"{k}: mlx_lm generate_step and the full-recompute reference disagree"
        out[k] = own
    assert len(set(out["llama"])) > 10  # varied output, not one repeated token
    return out


def test_loads_tiny_folders(verifiers):
    v = verifiers["gemma3"]
    assert (v.runtime, v.model_type, v.dtype, v.vocab_size, v.hidden_size, v.num_layers, v.max_context) == (
        "mlx", "gemma3_text", "float32", 320, 64, 6, 1024,
    )  # fmt: skip
    assert v.eos_token_ids == frozenset({1}) and v.tokenizer is None
    assert verifiers["llama"].eos_token_ids == frozenset({2})
    # sliding layers get a plain KVCache (window applied by the mask), so rollback is always exact
    assert {type(c).__name__ for c in v._cache} == {"KVCache"}
    v.check_rollback()


def test_config_fixes_transformers5_layouts():
    assert config_fixes({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}) == {
        "rope_theta": 5e5
    }
    assert config_fixes({"rope_theta": 1.0, "rope_parameters": {"rope_theta": 5e5}}) == {}
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    assert config_fixes({"rope_parameters": llama3}) == {
        "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    }
    gemma = {
        "model_type": "gemma3_text",
        "layer_types": ["sliding_attention"] * 3
        + ["full_attention"]
        + ["sliding_attention"] * 3
        + ["full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
        },
    }
    assert config_fixes(gemma) == {
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "sliding_window_pattern": 4,
    }
    with pytest.raises(ValueError, match="not periodic"):
        config_fixes({"model_type": "gemma3_text", "layer_types": ["sliding_attention", "full_attention"] * 2
                      + ["sliding_attention", "sliding_attention", "full_attention"]})  # fmt: skip


# ---- hidden-state capture ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_capture_is_bit_exact(verifiers, name):
    v = verifiers[name]
    model, layers = v.model, list(v.model.layers)
    ids = mx.array(PROMPT)[None]  # [1, P]
    ref = model(ids)  # [1, P, V], nothing wrapped
    v.set_target_layers(range(v.num_layers))
    store: dict = {}
    with v._tapped(store, last_only=False):
        tapped = model(ids)
    assert mx.array_equal(ref, tapped).item()
    assert all(a is b for a, b in zip(model.layers, layers))  # the model's list is restored
    assert sorted(store) == list(range(v.num_layers))

    # with a cache, in two calls: logits and cache equal bit for bit with and without capture
    def run(layer_ids):
        v.set_target_layers(layer_ids)
        v.reset()
        v._forward(PROMPT[:25], last_only=False)
        return v._forward(PROMPT[25:], last_only=False)  # [15, V]

    plain, captured = run(()), run(range(v.num_layers))
    assert mx.array_equal(plain, captured).item()
    last_only = (v.reset(), v._forward(PROMPT, last_only=True))[1]  # [1, V], LM head on the last position
    assert mx.array_equal(last_only[-1], ref[0, -1]).item()


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_features_match_transformers(paths, verifiers, name):
    """Layer l's capture == HF hidden_states[l+1]; the last layer against a hook on HF's last layer
    (HF's last hidden_states entry is after the final norm)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        paths[name], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    seen = {}
    hook = hf.model.layers[-1].register_forward_hook(lambda m, a, out: seen.update(last=out))
    with torch.inference_mode():
        hs = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    hook.remove()
    last = seen["last"][0] if isinstance(seen["last"], tuple) else seen["last"]
    L, H = len(hf.model.layers), hf.config.hidden_size
    expect = torch.stack([*(hs[l + 1][0] for l in range(L - 1)), last[0]], 1)  # [P, L, H]

    v = verifiers[name]
    v.set_target_layers(range(L))
    v.reset()
    v.prefill(PROMPT)
    got = v.features(PLEN, device="cpu", dtype=torch.float32).view(PLEN, L, H)  # [P, L, H]
    # fp32 kernels differ: 1e-4 relative to the activations' scale (the sharpened Llama reaches ~200)
    atol = 2e-5 * float(expect.abs().max().clamp(min=5.0))
    torch.testing.assert_close(got, expect, atol=atol, rtol=1e-4)


# ---- greedy equivalence ---------------------------------------------------------------------------------


def make_drafter(kind: str, ref: list[int], bs: int, v: MLXVerifier):
    kw = dict(
        vocab=v.vocab_size, block_size=bs, target_layer_ids=(0, v.num_layers - 1), hidden_size=v.hidden_size
    )
    if kind == "all":
        return ScriptedDrafter(PROMPT + ref, **kw)
    if kind == "none":
        return RandomDrafter(seed=3, **kw)
    wrong = {PLEN + i for i in (1, 2, 6, 13, 14, 15, 22, 30)}
    return ScriptedDrafter(PROMPT + ref, wrong_at=wrong, **kw)


@pytest.mark.parametrize("kind", ["all", "none", "part"])
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_greedy_equivalence(verifiers, refs, name, bs, kind):
    v, ref = verifiers[name], refs[name]
    drafter = make_drafter(kind, ref, bs, v)
    cfg = DecodeConfig(max_new_tokens=N_NEW, block_size=bs, stop_token_ids=frozenset())
    res = generate(v, PROMPT, drafter=drafter, cfg=cfg)
    assert res.output_tokens == ref
    steps = res.decode_steps
    if bs > 1:
        if kind == "all":
            assert all(s.accepted == s.drafted for s in steps)
        if kind == "part":
            assert 0 < sum(s.accepted for s in steps) < sum(s.drafted for s in steps)
        # the drafter got exactly the committed positions' features, equal to a one-shot prefill's
        full = torch.cat(drafter.features)  # [P + n, K*H]
        seq = PROMPT + ref
        assert drafter.tokens == seq[: full.shape[0]]
        v.set_target_layers(drafter.target_layer_ids)
        v.reset()
        v.prefill(seq[: full.shape[0]])
        torch.testing.assert_close(full, v.features(full.shape[0], device="cpu", dtype=torch.float32),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


# ---- rollback -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_rollback_then_repeat_is_exact(verifiers, name):
    v = verifiers[name]
    v.set_target_layers((1,))
    v.reset()
    v.prefill(PROMPT)  # Gemma: the 16-token window has wrapped (40 > 16)
    block = [11, 22, 33, 44, 55, 66, 77, 88]
    first = v._forward(block, last_only=False)  # [8, V]
    feats = v.features(8, device="cpu", dtype=torch.float32)
    v.rollback(len(block))
    assert v.position == PLEN
    again = v._forward(block, last_only=False)
    assert mx.array_equal(first, again).item()
    assert torch.equal(feats, v.features(8, device="cpu", dtype=torch.float32))


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_many_partial_rollbacks_match_full_recompute(verifiers, name):
    """Verify random blocks and keep a random prefix, many times past the window; the cache must then
    give what a fresh forward over the committed sequence gives."""
    v = verifiers[name]
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
    probe = [5, 6, 7]
    cached = v._forward(probe, last_only=False)  # [3, V]
    fresh = v.model(mx.array(seq + probe)[None])[0, -3:]  # no cache at all
    assert len(seq) > 2 * WINDOW
    assert mx.allclose(cached, fresh, atol=1e-4, rtol=1e-4).item()
    assert mx.array_equal(mx.argmax(cached, -1), mx.argmax(fresh, -1)).item()


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_run_ahead_is_invisible(verifiers, refs, name):
    """The autoregressive fast path queues step n+1 before it syncs step n. Whatever comes next (the
    queued token, another token, a block, a rollback, a prefill) sees what a synchronous loop leaves."""
    v, ref = verifiers[name], refs[name]

    def fresh(seq: list[int], n: int = 1) -> list[int]:  # greedy tokens after the last n, no cache
        return mx.argmax(v.model(mx.array(seq)[None])[0, -n:], axis=-1).tolist()

    v.set_target_layers(())
    v.reset()
    assert v.run_ahead
    out = [v.prefill(PROMPT)]
    for _ in range(5):
        out += v.verify([out[-1]], ahead=True)
    assert out == ref[:6] and v.position == PLEN + 5
    assert [c.offset for c in v._cache] == [PLEN + 6] * len(v._cache)  # one step queued, not counted
    seq = PROMPT + out[:-1] + [(out[-1] + 1) % v.vocab_size]  # not the queued token
    assert v.verify(seq[-1:], ahead=True) == fresh(seq)
    v.rollback(1)  # drops the newly queued step, then the token
    seq = [*seq[:-1], 5, 6, 7]
    assert v.verify(seq[-3:], ahead=True) == fresh(seq, 3) and v.position == len(seq)
    nxt = v.verify([11], ahead=True)  # queues a step on its result
    seq += [11, 9, 10]
    assert v.prefill(seq[-2:]) == fresh(seq)[0] and nxt == fresh(seq[:-2])
    assert [c.offset for c in v._cache] == [len(seq)] * len(v._cache) == [v.position] * len(v._cache)
    assert v.verify([3]) == fresh([*seq, 3])  # no `ahead`: nothing queued
    assert v._ahead is None


def test_window_is_applied_with_plain_kvcache(paths, verifiers):
    """Gemma's sliding layers on a plain KVCache still see only the last 16 positions: token-by-token
    decoding equals a cache-free forward (which builds the windowed mask itself), and a model without the
    window gives different logits (so the prompts do exercise it)."""
    v = verifiers["gemma3"]
    v.set_target_layers(())
    v.reset()
    v.prefill(PROMPT[:1])
    steps = [v._forward([t], last_only=False)[0] for t in PROMPT[1:]]  # each [V]
    stepwise = mx.stack(steps)  # [P-1, V]
    fresh = v.model(mx.array(PROMPT)[None])[0, 1:]  # [P-1, V]
    assert mx.allclose(stepwise, fresh, atol=1e-4, rtol=1e-4).item()
    wide = MLXVerifier(paths["gemma3"])
    wide.model.model.window_size = 10_000  # same weights, window never reached
    assert not mx.allclose(wide.model(mx.array(PROMPT)[None])[0, 1:], fresh, atol=1e-3).item()


def test_mlx_lm_rotating_cache_cannot_roll_back_after_wrap(verifiers):
    """The runtime trap this verifier avoids (mlx-lm #1423): once Gemma's RotatingKVCache has wrapped,
    trim_prompt_cache returns 0 silently. If this starts failing, mlx_lm changed: revisit the workaround."""
    v = verifiers["gemma3"]
    cache = make_prompt_cache(v.model)
    assert any(type(c) is RotatingKVCache for c in cache)
    v.model(mx.array(PROMPT)[None], cache=cache)
    assert trim_prompt_cache(cache, 3) == 0  # nothing trimmed, nothing raised
    # so a speculative loop that trusted it would go on from a cache still holding 3 rejected positions:
    after = v.model(mx.array([5])[None], cache=cache)[0, -1]  # [V]
    fresh = v.model(mx.array([*PROMPT[:-3], 5])[None])[0, -1]
    assert not mx.allclose(after, fresh, atol=1e-3).item()


def test_rollback_never_silent(verifiers):
    v = verifiers["llama"]
    v.set_target_layers(())
    v.reset()
    v.prefill(PROMPT)
    with pytest.raises(ValueError, match="cannot roll back 41 of 40"):
        v.rollback(41)
    v._cache[2].trim = lambda n: 0  # a cache that silently refuses
    with pytest.raises(RuntimeError, match="moved layer 2's KVCache from 40 to 40"):
        v.rollback(3)
    v.reset()


def test_unverified_rotating_cache_refused(paths):
    v = MLXVerifier(paths["gemma3"])
    v.model_type = "some_other_arch"  # pretend its mask handling was never checked
    v.reset()
    with pytest.raises(RuntimeError, match=r"uses cache types \['RotatingKVCache'\]"):
        v.check_rollback()


def test_recurrent_cache_refused():
    from mlx_lm.models import mamba

    args = mamba.ModelArgs(
        model_type="mamba", vocab_size=64, hidden_size=16, intermediate_size=32, state_size=4,
        num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=2,
    )  # fmt: skip
    v = MLXVerifier.from_model(mamba.Model(args), {"max_position_embeddings": 256}, name="tiny-mamba")
    with pytest.raises(
        RuntimeError, match=r"tiny-mamba \(mlx_lm 'mamba'\) uses cache types \['ArraysCache'\]"
    ):
        v.check_rollback()
    # autoregressive decoding still works (it never rolls back) ...
    res = generate(v, [1, 2, 3], cfg=DecodeConfig(max_new_tokens=5, block_size=1, stop_token_ids=frozenset()))
    assert len(res.output_tokens) == 5
    # ... a rollback does not
    v.reset()
    v.verify([1, 2, 3])
    with pytest.raises(RuntimeError, match="ArraysCache"):
        v.rollback(1)


# ---- quantized ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized_path(paths, tmp_path_factory) -> Path:
    """The tiny Llama, 4-bit (group size 32: hidden 64 and intermediate 128 divide), saved as mlx_lm
    saves mlx-community checkpoints."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    out = tmp_path_factory.mktemp("q4")
    model, config = load_model(paths["llama"])
    model, config = quantize_model(model, config, group_size=32, bits=4)
    save_model(out, model)
    save_config(config, out / "config.json")
    shutil.copy(paths["llama"] / "generation_config.json", out)
    return out


def test_quantized_model(quantized_path):
    import mlx.nn as nn

    v = MLXVerifier(quantized_path)
    assert isinstance(v.model.model.embed_tokens, nn.QuantizedEmbedding)
    ref = parity.mlx_lm_greedy(v, PROMPT, 24)
    assert greedy_reference(v, PROMPT, 24) == ref
    drafter = ScriptedDrafter(PROMPT + ref, wrong_at={PLEN + 3, PLEN + 9}, vocab=v.vocab_size, block_size=6,
                              target_layer_ids=(1, 3), hidden_size=v.hidden_size)  # fmt: skip
    cfg = DecodeConfig(max_new_tokens=24, block_size=6, stop_token_ids=frozenset())
    assert generate(v, PROMPT, drafter=drafter, cfg=cfg).output_tokens == ref


# ---- cross-runtime and real models ------------------------------------------------------------------------


@pytest.mark.hf
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_same_tokens_and_features_as_hf_verifier(paths, verifiers, refs, name):
    hfmod = pytest.importorskip("specdec.verifiers.hf")
    hv, v = hfmod.HFVerifier(paths[name]), verifiers[name]
    assert greedy_reference(hv, PROMPT, N_NEW) == refs[name]
    ids = (0, 2, v.num_layers - 1)
    for ver in (hv, v):
        ver.set_target_layers(ids)
        ver.reset()
        ver.prefill(PROMPT)
    kw = dict(device="cpu", dtype=torch.float32)
    expect = hv.features(PLEN, **kw)  # [P, 3*H]
    atol = 2e-5 * float(expect.abs().max().clamp(min=5.0))
    torch.testing.assert_close(v.features(PLEN, **kw), expect, atol=atol, rtol=1e-4)


def _narrow_window(src: Path, dest: Path, window: int) -> Path:
    """The real model with its sliding window cut to `window` (weights linked, config edited), so that a
    short prompt wraps Gemma's rotating caches: prefill on mlx-cpu's reference BLAS costs ~0.15 s a token."""
    dest.mkdir()
    for f in src.iterdir():
        (dest / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    cfg["sliding_window"] = window
    (dest / "config.json").unlink()
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("short", ["smollm2-135m", "gemma3-270m"])
def test_real_model_speculative_equals_mlx_lm(short, tmp_path):
    models = pytest.importorskip("specdec.models", reason="specdec.models (fetch) not written yet")
    path = models.fetch(short)
    if short.startswith("gemma"):
        path = _narrow_window(path, tmp_path / short, window=32)
    v = MLXVerifier(path)
    assert v.tokenizer is not None and v.eos_token_ids
    prompt = v.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5)  # Gemma: past 32
    ref = parity.mlx_lm_greedy(v, prompt, 32)
    drafter = ScriptedDrafter(prompt + ref, wrong_at={len(prompt) + i for i in (2, 9, 10, 27)},
                              vocab=v.vocab_size, block_size=8, target_layer_ids=(1, v.num_layers - 1),
                              hidden_size=v.hidden_size)  # fmt: skip
    cfg = DecodeConfig(max_new_tokens=32, block_size=8, stop_token_ids=frozenset())
    assert generate(v, prompt, drafter=drafter, cfg=cfg).output_tokens == ref


def test_sample_hook_and_bf16(paths, refs):
    """`sample` sees the logits as torch [T, V]; a bf16 verifier loads, decodes and reports its dtype."""
    v = MLXVerifier(paths["llama"], dtype="bfloat16")
    assert v.dtype == "bfloat16"
    seen = []

    def argmax(logits: torch.Tensor) -> list[int]:
        seen.append((tuple(logits.shape), logits.dtype))
        return logits.float().argmax(-1).tolist()

    v.prefill(PROMPT, sample=argmax)
    out = v.verify(refs["llama"][:4], sample=argmax)
    assert seen == [((1, 320), torch.bfloat16), ((4, 320), torch.bfloat16)] and len(out) == 4
    with pytest.raises(ValueError, match="dtype 'int8' not supported"):
        MLXVerifier(paths["llama"], dtype="int8")


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_chunked_prefill(paths, verifiers, name):
    v, chunked = verifiers[name], MLXVerifier(paths[name], prefill_chunk=7)
    for ver in (v, chunked):
        ver.set_target_layers((0, 2))
        ver.reset()
    assert chunked.prefill(PROMPT) == v.prefill(PROMPT)
    assert chunked.position == PLEN
    kw = dict(device="cpu", dtype=torch.float32)
    torch.testing.assert_close(chunked.features(PLEN, **kw), v.features(PLEN, **kw), atol=1e-4, rtol=1e-5)
