"""Tiny random EAGLE-3 checkpoints in each public dialect, and an independent reference of EAGLE-3 drafting.

`tiny_eagle3` writes what the three dialects publish (speculators: `Eagle3Speculator` config with
`transformer_layer_config` and `speculators_config`, safetensors with `layers.{i}.*`; yuhuili's: a flat
config with `draft_vocab_size`, `pytorch_model.bin` with `midlayer.*`; SGLang's: `LlamaForCausalLMEagle3`
with safetensors), seeded, fp32, its LM head sharpened so greedy drafts have clear margins.

`reference_draft` is written from vLLM's `llama_eagle3.py` and speculators' `Eagle3DraftModel`, not from
specdec's code: every row recomputed from scratch with full causal attention at RoPE positions r (vLLM's),
chains by appending rows and recomputing everything.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def tiny_eagle3(
    path: Path, *, target_hidden: int, vocab: int, aux: list[int] | None, dialect: str = "speculators",
    draft_vocab: int | None = None, layers: int = 1, heads: int = 4, kv_heads: int = 2, qwen3: bool = False,
    embed: bool = False, flags: dict | None = None, seed: int = 0, sharpen: float = 6.0, k: int = 5,
    parallel_mask: int | None = None,
) -> Path:  # fmt: skip
    """A random EAGLE-3 checkpoint folder for a target of hidden size `target_hidden` and vocabulary
    `vocab`, reading aux layers `aux` (None: the config names none)."""
    g = torch.Generator().manual_seed(seed)
    H, I, D = target_hidden, 2 * target_hidden, target_hidden // heads
    K = draft_vocab or vocab
    flags = dict(flags or {})
    n_aux = len(aux) if aux else 3

    def w(*shape: int, scale: float = 0.0) -> torch.Tensor:
        s = scale or shape[-1] ** -0.5
        return torch.randn(*shape, generator=g) * s

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {"fc.weight": w(H, n_aux * H), "norm.weight": norm(H), "lm_head.weight": w(K, H) * sharpen}
    for i in range(layers):
        p, inp = f"layers.{i}.", 2 * H if i == 0 else H
        a, m = p + "self_attn.", p + "mlp."
        sd |= {a + "q_proj.weight": w(heads * D, inp), a + "k_proj.weight": w(kv_heads * D, inp),
               a + "v_proj.weight": w(kv_heads * D, inp), a + "o_proj.weight": w(H, heads * D),
               m + "gate_proj.weight": w(I, H), m + "up_proj.weight": w(I, H),
               m + "down_proj.weight": w(H, I), p + "input_layernorm.weight": norm(H),
               p + "post_attention_layernorm.weight": norm(H)}  # fmt: skip
        if qwen3:
            sd |= {p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D)}
        if i == 0:
            sd[p + "hidden_norm.weight"] = norm(H)
    if flags.get("norm_before_fc"):
        sd["input_norm.weight"] = norm(n_aux * H)
    if flags.get("fc_norm"):
        sd |= {f"fc_norm.{j}.weight": norm(H) for j in range(n_aux)}
    if embed:
        sd["embed_tokens.weight"] = w(vocab, H, scale=1.0)
    if parallel_mask is not None:  # P-EAGLE
        sd["mask_hidden"] = w(1, 1, n_aux * H, scale=1.0)
    if vocab != K:  # a spread-out draft vocabulary: every id under K/2, then every other one
        ids = torch.cat([torch.arange(K // 2), torch.arange(K // 2, vocab, 2)[: K - K // 2]])
        sd["d2t"] = ids - torch.arange(K)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        sd["t2d"] = t2d
    layer = dict(model_type="qwen3" if qwen3 else "llama", hidden_size=H, intermediate_size=I,
                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                 head_dim=D, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=vocab,
                 max_position_embeddings=2048)  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    if dialect == "speculators":
        method = dict(proposal_type="greedy", speculative_tokens=k)
        spec = dict(algorithm="eagle3", default_proposal_method="greedy", proposal_methods=[method],
                    verifier=dict(name_or_path="tiny-target", architectures=["X"]))  # fmt: skip
        algo = "eagle3" if parallel_mask is None else "peagle"
        cfg = dict(architectures=["Eagle3Speculator"], speculators_model_type=algo,
                   transformer_layer_config=layer, draft_vocab_size=K, target_hidden_size=H, **flags,
                   speculators_config=spec)  # fmt: skip
        if aux:
            cfg["eagle_aux_hidden_state_layer_ids"] = aux
        if parallel_mask is not None:
            cfg["mask_token_id"] = parallel_mask
        sd["verifier_lm_head.weight"] = w(K, H)  # training's copy of the verifier's head: not read
        _safetensors(path, sd)
    else:
        cfg = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=K, **flags)
        if aux:
            cfg["eagle_aux_hidden_state_layer_ids"] = aux
        renamed = {
            ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
            for k, v in sd.items()
        }
        if dialect == "yuhuili":
            torch.save(renamed, path / "pytorch_model.bin")
        else:
            _safetensors(path, renamed)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def _safetensors(path: Path, sd: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))


# ---- the reference ---------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv  # [T, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rot = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return (x.double() * cos + rot.double() * sin).to(x.dtype)


def _layer(
    sd: dict, p: str, x: torch.Tensor, cfg: dict, first: bool, emb: torch.Tensor | None
) -> torch.Tensor:
    """One decoder layer over every row [T, H] with full causal attention."""
    lc = cfg.get("transformer_layer_config", cfg)
    nh, nkv = lc["num_attention_heads"], lc["num_key_value_heads"]
    D = lc["head_dim"]
    if first:
        normed = _rms(x, sd[p + "hidden_norm.weight"])
        inp = torch.cat([_rms(emb, sd[p + "input_layernorm.weight"]), normed], -1)
        residual = normed if cfg.get("norm_before_residual") else x
    else:
        inp, residual = _rms(x, sd[p + "input_layernorm.weight"]), x
    T = x.shape[0]
    q = (inp @ sd[p + "self_attn.q_proj.weight"].T).view(T, nh, D)
    k = (inp @ sd[p + "self_attn.k_proj.weight"].T).view(T, nkv, D)
    v = (inp @ sd[p + "self_attn.v_proj.weight"].T).view(T, nkv, D)
    if lc.get("model_type") == "qwen3":
        q, k = _rms(q, sd[p + "self_attn.q_norm.weight"]), _rms(k, sd[p + "self_attn.k_norm.weight"])
    pos = torch.arange(T)  # vLLM: row r at position r
    q, k = _rope(q.transpose(0, 1), pos), _rope(k.transpose(0, 1), pos)  # [n, T, D]
    k, v = k.repeat_interleave(nh // nkv, 0), v.transpose(0, 1).repeat_interleave(nh // nkv, 0)
    scores = (q @ k.transpose(1, 2)) / D**0.5 + torch.full((T, T), float("-inf")).triu(1)
    att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, nh * D)
    h = residual + att @ sd[p + "self_attn.o_proj.weight"].T
    m = _rms(h, sd[p + "post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (
        m @ sd[p + "mlp.up_proj.weight"].T
    )
    return h + mlp @ sd[p + "mlp.down_proj.weight"].T


def reference_draft(
    folder: Path, embed: torch.Tensor, tokens: list[int], feats: torch.Tensor, last: int, n: int
) -> tuple[list[int], torch.Tensor]:
    """The greedy chain of n drafts after `last` given the committed `tokens` [L] and their aux features
    [L, A*H], recomputed from scratch: (target ids, logits [n, K] over the draft vocabulary)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    f = folder / "model.safetensors"
    sd = load_file(str(f)) if f.is_file() else torch.load(folder / "pytorch_model.bin", weights_only=True)
    sd = {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in sd.items()}
    emb_w = sd.get("embed_tokens.weight", embed)
    layers = len({k.split(".")[1] for k in sd if k.startswith("layers.")})
    x = feats
    if cfg.get("norm_before_fc"):
        x = _rms(x, sd["input_norm.weight"])
    if cfg.get("fc_norm"):
        x = torch.cat(
            [
                _rms(c, sd[f"fc_norm.{j}.weight"])
                for j, c in enumerate(x.chunk(len(x[0]) // embed.shape[1], -1))
            ],
            -1,
        )
    hidden = x @ sd["fc.weight"].T  # [L, H]
    ids = [*tokens[1:], last]
    to_target = (lambda j: j + int(sd["d2t"][j])) if "d2t" in sd else (lambda j: j)
    drafts, logits = [], []
    for _ in range(n):
        h = hidden
        for i in range(layers):
            h = _layer(sd, f"layers.{i}.", h, cfg, i == 0, emb_w[torch.tensor(ids)])
        normed = _rms(h[-1], sd["norm.weight"])
        lg = normed @ sd["lm_head.weight"].T
        logits.append(lg)
        drafts.append(to_target(int(lg.argmax())))
        nxt = normed if cfg.get("norm_output") else h[-1]
        hidden, ids = torch.cat([hidden, nxt[None]]), [*ids, drafts[-1]]
    return drafts, torch.stack(logits)


def reference_parallel(
    folder: Path, embed: torch.Tensor, tokens: list[int], feats: torch.Tensor, last: int, n: int
) -> tuple[list[int], torch.Tensor]:
    """P-EAGLE's n drafts after `last`, recomputed from scratch: the committed rows, then n - 1 rows of the
    mask token with fc(mask_hidden) as hidden, under speculators' mask (every row sees the context rows at or
    before its anchor and its own rollout's rows of lower depth: causal order here)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    sd = load_file(str(folder / "model.safetensors"))
    layers = len({k.split(".")[1] for k in sd if k.startswith("layers.")})
    x = torch.cat([feats, sd["mask_hidden"][0].expand(n - 1, -1)])
    hidden = x @ sd["fc.weight"].T
    ids = [*tokens[1:], last, *[cfg["mask_token_id"]] * (n - 1)]
    h = hidden
    for i in range(layers):
        h = _layer(sd, f"layers.{i}.", h, cfg, i == 0, embed[torch.tensor(ids)])
    logits = _rms(h[-n:], sd["norm.weight"]) @ sd["lm_head.weight"].T
    to_target = (lambda j: j + int(sd["d2t"][j])) if "d2t" in sd else (lambda j: j)
    return [to_target(int(j)) for j in logits.argmax(-1)], logits
