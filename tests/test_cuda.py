"""What only a CUDA GPU can show (skipped elsewhere; `bash evals/gpu_check.sh` runs them on a lent GPU):
the drafter and an HF verifier on CUDA decode exactly, and every step's peak memory is the CUDA
allocator's own peak, reset before the step's phase (never the process's, never a stale peak)."""

from __future__ import annotations

import pytest
import torch
from test_dflash import make_model, stub_cfg

from specdec.drafting.dflash.torch import DFlashDrafter
from specdec.drafting.lookup.prompt import PromptLookupDrafter
from specdec.engine import DecodeConfig, generate
from specdec.verifiers.stub import StubVerifier

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPT = [256, *b"def add(a, b):\n    return a + b\n\ndef add(a, b):\n"]
CUDA_PEAK = "torch.cuda.max_memory_allocated"
SPIKE = 256 * 2**20  # bytes allocated (and freed) between steps


class _Spiking(DFlashDrafter):
    """A DFlash drafter that allocates SPIKE bytes on the GPU between its proposals: a probe that was not
    reset before a proposal would report at least that."""

    def extend(self, features, tokens):
        spike = torch.empty(SPIKE, dtype=torch.uint8, device="cuda")
        del spike
        super().extend(features, tokens)


def test_dflash_drafter_on_cuda_exact_with_per_step_cuda_peaks():
    v = StubVerifier()
    drafter = _Spiking(make_model(stub_cfg()).to("cuda"))
    drafter.bind(v)
    cfg = DecodeConfig(max_new_tokens=48, block_size=8, stop_token_ids=frozenset())
    res = generate(v, PROMPT, drafter=drafter, cfg=cfg)
    ar = generate(v, PROMPT, cfg=DecodeConfig(max_new_tokens=48, block_size=1, stop_token_ids=frozenset()))
    assert res.output_tokens == ar.output_tokens
    peaks = [s.peak_memory["drafter"] for s in res.decode_steps if s.drafted]
    assert peaks and all(p["source"] == CUDA_PEAK and p["kind"] == "peak" for p in peaks)
    assert all(0 < p["bytes"] < SPIKE for p in peaks), [p["bytes"] for p in peaks]


def test_hf_verifier_on_cuda_exact_with_cuda_peaks(tmp_path):
    pytest.importorskip("transformers")
    import tinymodels

    from specdec.verifiers.hf import HFVerifier

    path = tinymodels.tiny_llama(tmp_path / "llama")
    v = HFVerifier(path, device="cuda")
    prompt = [(7 * i) % 300 + 5 for i in range(40)] * 2
    cfg = DecodeConfig(max_new_tokens=32, block_size=8, stop_token_ids=frozenset())
    ar = generate(v, prompt, cfg=DecodeConfig(max_new_tokens=32, block_size=1, stop_token_ids=frozenset()))
    res = generate(v, prompt, drafter=PromptLookupDrafter(block_size=8), cfg=cfg)
    assert res.output_tokens == ar.output_tokens
    peaks = [s.peak_memory["verifier"] for s in res.steps]
    assert all(p["source"] == CUDA_PEAK and p["bytes"] > 0 for p in peaks)
    assert peaks[0]["bytes"] > min(p["bytes"] for p in peaks[1:])  # the prefill's peak is not carried over
