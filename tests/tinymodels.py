"""Tiny random models of the real families, saved as HF folders that transformers and mlx_lm both load.

Built with transformers' own config classes, fp32, seeded. Sliding windows are smaller than the test
prompts so the window wraps.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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


def tiny_gemma3(path: Path, *, seed: int = 0, sliding_window: int = 16, softcap: float | None = 30.0) -> Path:
    """Gemma 3 text model. `softcap` None as released Gemma 3 configs have it (transformers' multimodal
    Gemma 3 and mlx_lm's never soft-cap; its causal LM does where the config asks)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
        sliding_window=sliding_window, final_logit_softcapping=softcap, bos_token_id=2, eos_token_id=1,
        pad_token_id=0,
    )  # fmt: skip
    return _save(Gemma3ForCausalLM(cfg).eval(), path)


def tiny_gemma4(
    path: Path,
    *,
    seed: int = 0,
    sliding_window: int = 16,
    moe: bool = False,
    kv_shared: int | None = None,
    vocab: int = 320,
) -> Path:
    """Gemma 4 text model: sliding + full layers (the full ones with their own head_dim and proportional
    partial RoPE), soft-capping 30, tied head, layer scalars != 1. Dense is shaped like E2B/E4B: per-layer
    inputs and the last 2 layers KV-shared (no cache entry of their own). MoE is shaped like 26B-A4B: the
    MoE block beside the MLP, K=V on full layers with their own KV-head count, no KV sharing.
    `kv_shared` overrides the number of KV-shared layers."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    kw: dict = (
        dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
             attention_k_eq_v=True, num_global_key_value_heads=2, hidden_size_per_layer_input=0,
             num_kv_shared_layers=0)
        if moe
        else dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab, num_kv_shared_layers=2)
    )  # fmt: skip
    if kv_shared is not None:
        kw["num_kv_shared_layers"] = kv_shared
    cfg = Gemma4TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        max_position_embeddings=1024, sliding_window=sliding_window, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        bos_token_id=2, eos_token_id=1, pad_token_id=0, **kw,
    )  # fmt: skip
    model = Gemma4ForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves these at 1: vary them so a formula that skips one shows
        for layer in model.model.layers:
            layer.layer_scalar.fill_(0.5 + torch.rand(()).item())
            if moe:
                layer.router.scale.uniform_(0.5, 1.5)
                layer.router.per_expert_scale.uniform_(0.5, 1.5)
    return _save(model, path)


def tiny_gemma4_unified(path: Path, *, seed: int = 0, sliding_window: int = 16, vision: bool = True) -> Path:
    """Gemma 4 unified (`gemma4_unified`, the 12B's family): Gemma 4 without per-layer inputs or MoE, its
    sliding and full layers as `tiny_gemma4`'s, the last 2 KV-shared, layer scalars != 1. With `vision`
    saved as real checkpoints are, `Gemma4UnifiedForConditionalGeneration` with a tiny encoder-free
    vision embedder (`model.language_model.*`); else the text model alone."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    text = tf.Gemma4UnifiedTextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        max_position_embeddings=1024, sliding_window=sliding_window, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        bos_token_id=2, eos_token_id=1, pad_token_id=0, num_kv_shared_layers=2,
    )  # fmt: skip
    if vision:
        eyes = tf.Gemma4UnifiedVisionConfig(patch_size=4, pooling_kernel_size=2, mm_embed_dim=32,
                                            mm_posemb_size=8, output_proj_dims=64)  # fmt: skip
        cfg = tf.Gemma4UnifiedConfig(text_config=text, vision_config=eyes, audio_config=None)
        model = tf.Gemma4UnifiedForConditionalGeneration(cfg).eval()
    else:
        model = tf.Gemma4UnifiedForCausalLM(text).eval()
    with torch.no_grad():  # random init leaves these at 1: vary them so a formula that skips one shows
        for layer in model.get_decoder().layers:
            layer.layer_scalar.fill_(0.5 + torch.rand(()).item())
    return _save(model, path)


def with_vision(path: Path, text_path: Path) -> Path:
    """The multimodal checkpoint of the Gemma 3 / Gemma 4 text model in `text_path`, as real ones are
    saved (`...ForConditionalGeneration`: `model.language_model.*`, a tiny vision tower): the same
    language model, so both folders give the same logits."""
    import torch
    import transformers as tf

    text = tf.AutoModelForCausalLM.from_pretrained(text_path).eval()
    cfg = text.config
    if cfg.model_type == "gemma4_text":
        eyes = tf.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, head_dim=16)  # fmt: skip
        model = tf.Gemma4ForConditionalGeneration(tf.Gemma4Config(text_config=cfg, vision_config=eyes))
    else:
        eyes = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
        model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(text_config=cfg, vision_config=eyes,
                                                                  mm_tokens_per_image=4))  # fmt: skip
    with torch.no_grad():
        model.model.language_model.load_state_dict(text.model.state_dict())
        model.lm_head.load_state_dict(text.lm_head.state_dict())
    return _save(model.eval(), path)


def tiny_gemma4_assistant(
    path: Path,
    *,
    seed: int = 0,
    sliding_window: int = 16,
    moe: bool = False,
    ordered: bool = False,
    drafts: int | None = None,
    vocab: int = 320,
    centroids: int = 16,
    unified: bool = False,
) -> Path:
    """A Gemma-4 assistant for `tiny_gemma4` (same `sliding_window` and `moe`): two KV-shared layers
    (sliding, full) of hidden 32 reading the target's K/V shapes, pre/post projections to its hidden 64,
    and with `ordered` a centroid head (`centroids` of vocab / centroids tokens each, top 4 or half of
    them) over a random token order. `unified`: a `gemma4_unified_assistant`, for `tiny_gemma4_unified`.
    `drafts`: the `num_assistant_tokens` its generation_config.json names."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    kv = dict(attention_k_eq_v=True, num_global_key_value_heads=2) if moe else {}
    if not unified:
        kv |= dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    text = (tf.Gemma4UnifiedTextConfig if unified else tf.Gemma4TextConfig)(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, global_head_dim=32, sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=2,
        final_logit_softcapping=30.0, max_position_embeddings=1024, bos_token_id=2, eos_token_id=1,
        pad_token_id=0, **kv,
    )  # fmt: skip
    config, cls = ((tf.Gemma4UnifiedAssistantConfig, tf.Gemma4UnifiedAssistantForCausalLM) if unified
                   else (tf.Gemma4AssistantConfig, tf.Gemma4AssistantForCausalLM))  # fmt: skip
    cfg = config(
        text_config=text, backbone_hidden_size=64, use_ordered_embeddings=ordered, num_centroids=centroids,
        centroid_intermediate_top_k=min(4, centroids // 2),
    )  # fmt: skip
    model = cls(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.fill_(0.5 + torch.rand(()).item())
        if ordered:
            order = torch.randperm(vocab)
            model.masked_embedding.token_ordering.copy_(order)
            # as trained ones are: each centroid near its tokens' head rows (their mean, scaled up)
            rows = model.lm_head.weight[order.view(centroids, -1)]  # [C, V/C, H]
            model.masked_embedding.centroids.weight.copy_(rows.mean(1) * rows.shape[1] ** 0.5)
    if drafts is not None:
        model.generation_config.num_assistant_tokens = drafts
    return _save(model, path)


def tiny_qwen3(path: Path, *, seed: int = 0, moe: bool = False) -> Path:
    """Qwen3 (q/k norms, head_dim != hidden/heads, untied head) or Qwen3-MoE (top-2 of 4 experts,
    normalised, layer 1 dense)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rope_theta=1e6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if moe:
        cfg = Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             norm_topk_prob=True, mlp_only_layers=[1])  # fmt: skip
        return _save(Qwen3MoeForCausalLM(cfg).eval(), path)
    return _save(Qwen3ForCausalLM(Qwen3Config(**common)).eval(), path)


def tiny_tokenizer(
    path: Path, *, chat_template: str | None = None, bos: int = 2, eos: int = 1, more: Sequence[str] = ()
) -> Path:
    """A byte-level tokenizer for the tiny models (ids: <pad> 0, <eos> 1, <bos> 2, <start_of_turn> 3,
    <end_of_turn> 4, then the 256 bytes, then the special tokens `more` from 261), saved next to a model as
    transformers writes one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    byte_names = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials + sorted(byte_names) + list(more))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    names = {bos: "bos_token", eos: "eos_token", 0: "pad_token"}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, additional_special_tokens=specials[3:] + list(more),
        **{name: specials[i] for i, name in names.items()},
    )  # fmt: skip
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(path)
    return path


def _sharpen(model, factor: float = 4.0) -> None:
    """Scale the LM head so a random model's argmax leads its runner-up by a clear margin (rounding noise
    between two correct implementations then cannot flip a greedy choice)."""
    import torch

    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)


#: Gated DeltaNet widths of the tiny hybrids: 32 value heads as Qwen3.5-4B / 9B / 35B-A3B and Qwen3-Next
#: have (on a CPU the per-head gates of one token then fill whole vectors, as in a verify of several)
_GDN = dict(linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=4,
            linear_value_head_dim=4, linear_conv_kernel_dim=4)  # fmt: skip
_HYBRID = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
               tie_word_embeddings=False, bos_token_id=2, eos_token_id=1, pad_token_id=0)  # fmt: skip
_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
)


def tiny_qwen3_5(
    path: Path,
    *,
    seed: int = 0,
    moe: bool = False,
    multimodal: bool = True,
    vocab: int = 320,
    layers: int = 8,
) -> Path:
    """Qwen3.5 (dense, or MoE: top-2 of 4 experts plus a shared expert): 3 Gated DeltaNet layers then one
    gated full-attention layer, twice (`layers` 4: once). `multimodal`: the layout of the real checkpoints
    (`Qwen3_5ForConditionalGeneration`: `text_config`, a tiny vision tower, `model.language_model.*`);
    otherwise transformers' text-only `Qwen3_5ForCausalLM`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    name = "qwen3_5_moe" if moe else "qwen3_5"
    hybrid = {**_HYBRID, "vocab_size": vocab, "num_hidden_layers": layers}
    text = dict(**hybrid, **_GDN, **(_MOE if moe else {}))
    if multimodal:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=4, num_position_embeddings=16)  # fmt: skip
        cfg = transformers.AutoConfig.for_model(name, text_config=text, vision_config=vision)
        model = transformers.AutoModelForImageTextToText.from_config(cfg).eval()
    else:
        cfg = transformers.AutoConfig.for_model(f"{name}_text", **text)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    _sharpen(model)
    return _save(model, path)


def tiny_qwen3_next(path: Path, *, seed: int = 0) -> Path:
    """Qwen3-Next: the Qwen3.5 hybrid with fused projections and MoE in every layer."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model("qwen3_next", **_HYBRID, **_GDN, **_MOE)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    _sharpen(model)
    return _save(model, path)


def tiny_gpt_oss(path: Path, *, seed: int = 0, sliding_window: int = 16) -> Path:
    """gpt-oss: sliding and full attention layers alternating, attention sinks (made non-zero), biased
    projections, top-2 of 4 experts with the clamped SwiGLU, YaRN RoPE."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(
        "gpt_oss", vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=sliding_window, max_position_embeddings=1024,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    _sharpen(model)
    return _save(model, path)


def add_mtp(path: Path, *, seed: int = 0) -> Path:
    """Give a tiny Qwen3.5 / Qwen3-Next folder one MTP layer as the real checkpoints ship it
    (`specdec.evals.mtp_cost.add_mtp_layers`)."""
    from specdec.evals.mtp_cost import add_mtp_layers

    return add_mtp_layers(path, seed=seed)
