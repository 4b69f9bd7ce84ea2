"""The bundled drafters: public format on disk, bind to their real models, decode exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from specdec.api import bundled_corpus, bundled_drafter, load_drafter
from specdec.bundled import BUNDLED
from specdec.drafting.dflash.config import load_checkpoint

# model -> (hidden size, vocabulary, verifier layers) of its verifier; every entry of BUNDLED needs one
SHAPES = {"smollm2-135m": (576, 49152, 30), "gemma3-270m": (640, 262144, 18)}


@pytest.mark.parametrize("model", sorted(BUNDLED))
def test_bundled_drafter_is_public_format_bf16(model):
    hidden, vocab, layers = SHAPES[model]
    path = bundled_drafter(model)
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert (raw["hidden_size"], raw["vocab_size"], raw["num_target_layers"]) == (hidden, vocab, layers)
    assert all(0 <= i < layers for i in raw["dflash_config"]["target_layer_ids"])
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 - not a dict
    cfg, state = load_checkpoint(path)
    assert state["fc.weight"].shape == (hidden, hidden * len(cfg.target_layer_ids))


@pytest.mark.parametrize("model", sorted(BUNDLED))
def test_bundled_corpus_was_written_by_the_model(model):
    from specdec.drafting.lookup.ngrams import check_corpus

    assert check_corpus(bundled_corpus(model))["vocab_size"] == SHAPES[model][1]
    assert bundled_corpus("llama-70b") is None


def test_no_bundled_drafter_for_unknown_model():
    with pytest.raises(ValueError, match="no bundled drafter for 'llama-70b'"):
        bundled_drafter("llama-70b")


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.parametrize("model", sorted(BUNDLED))
def test_bundled_drafter_binds_and_decodes_exactly(model):
    pytest.importorskip("transformers")
    from specdec.api import encode_prompt, load_verifier
    from specdec.costs import VerifyCosts
    from specdec.engine import DecodeConfig, generate

    v = load_verifier("hf", model)
    d = load_drafter(f"bundled:{model}", verifier=v)
    ids = encode_prompt(v, [{"role": "user", "content": "Write a Python function that adds two numbers."}])
    cfg = dict(max_new_tokens=48)
    ar = generate(v, ids, cfg=DecodeConfig(block_size=1, **cfg))
    spec = generate(v, ids, drafter=d, cfg=DecodeConfig(block_size=d.block_size, **cfg))
    assert spec.output_tokens == ar.output_tokens
    assert sum(s.accepted for s in spec.decode_steps) > 0  # a trained drafter gets something accepted
    for costs in (None, VerifyCosts.measure(v, reps=1)):  # the demo's on a CPU: drafts cut by verify costs
        mix = load_drafter(f"bundled:{model}+lookup", verifier=v, corpus=bundled_corpus(model), costs=costs)
        spec = generate(v, ids, drafter=mix, cfg=DecodeConfig(block_size=mix.block_size, **cfg))
        assert spec.output_tokens == ar.output_tokens and mix.counts["corpus"] > 0
    assert torch.get_default_dtype() == torch.float32
