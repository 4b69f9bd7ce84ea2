"""The bundled SmolLM2 drafter: public format on disk, binds to the real model, decodes exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from specdec.api import bundled_drafter, load_drafter
from specdec.checkpoint import load_checkpoint


def test_bundled_drafter_is_public_format_bf16():
    path = bundled_drafter("smollm2-135m")
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["hidden_size"] == 576 and raw["vocab_size"] == 49152 and raw["num_target_layers"] == 30
    assert all(0 <= i < 30 for i in raw["dflash_config"]["target_layer_ids"])
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 - not a dict
    cfg, state = load_checkpoint(path)
    assert state["fc.weight"].shape == (576, 576 * len(cfg.target_layer_ids))


def test_no_bundled_drafter_for_unknown_model():
    with pytest.raises(ValueError, match="no bundled drafter for 'llama-70b'"):
        bundled_drafter("llama-70b")


@pytest.mark.slow
@pytest.mark.hf
def test_bundled_drafter_binds_and_decodes_exactly():
    pytest.importorskip("transformers")
    from specdec.api import encode_prompt, load_verifier
    from specdec.engine import DecodeConfig, generate

    v = load_verifier("hf", "smollm2-135m")
    d = load_drafter("bundled:smollm2-135m", verifier=v)
    ids = encode_prompt(v, [{"role": "user", "content": "Write a Python function that adds two numbers."}])
    cfg = dict(max_new_tokens=48)
    ar = generate(v, ids, cfg=DecodeConfig(block_size=1, **cfg))
    spec = generate(v, ids, drafter=d, cfg=DecodeConfig(block_size=d.block_size, **cfg))
    assert spec.output_tokens == ar.output_tokens
    assert sum(s.accepted for s in spec.decode_steps) > 0  # a trained drafter gets something accepted
    assert torch.get_default_dtype() == torch.float32
