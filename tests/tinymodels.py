"""Tiny random models of the real families, saved as HF folders that transformers and mlx_lm both load.

Built with transformers' own config classes, fp32, seeded. Sliding windows are smaller than the test
prompts so the window wraps.
"""

from __future__ import annotations

import json
from pathlib import Path


def _save(model, path: Path, extra_config: dict | None = None) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # mlx_lm reads a top-level rope_theta; transformers 5 only writes rope_parameters.rope_theta
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg.update(extra_config or {})
    cfg_path.write_text(json.dumps(cfg, indent=1))
    return path


def tiny_llama(path: Path, *, seed: int = 0, tie: bool = False) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return _save(LlamaForCausalLM(cfg).eval(), path)


def tiny_gemma3(path: Path, *, seed: int = 0, sliding_window: int = 16) -> Path:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
        sliding_window=sliding_window, final_logit_softcapping=30.0, bos_token_id=2, eos_token_id=1,
        pad_token_id=0,
    )  # fmt: skip
    return _save(Gemma3ForCausalLM(cfg).eval(), path)
