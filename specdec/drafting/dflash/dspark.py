"""DSpark drafters (DeepSeek, June 2026): a DFlash block backbone plus a low-rank Markov head and a confidence
head, read as a DFlash checkpoint with `DSparkParams` attached (as DFlash2 attaches its selector).

The checkpoint (e.g. `deepseek-ai/dspark_qwen3_4b_block7`, mlx-vlm's `dspark` reads the same): a Qwen3
config whose `dflash_config` says `projector_type: dspark` and carries `mask_token_id`, `target_layer_ids`,
`block_size` (the proposals per block; one more where `dspark_bonus_anchor` is false), `markov_rank`,
`markov_head_type` (vanilla), `enable_confidence_head`, `confidence_head_with_markov` and
`sample_from_anchor` (default true: the anchor's own position drafts the first token, so a block of
proposals is [anchor, MASK x (n-1)]); weights: the DFlash ones, `markov_head.markov_w{1,2}.weight`,
`confidence_head.proj.{weight,bias}` and possibly `embed_tokens.weight` (its own embeddings).

Drafting (`markov_walk`): the backbone gives base logits for every proposal; proposal i's logits are those
plus `markov_w2(markov_w1[previous token])`, the previous token being the anchor for the first and the
token drafted before it otherwise, so drafts are a walk (greedy, or sampled with q at T > 0). The
confidence head, sigmoid(proj(concat(hidden_i, markov_w1[previous]))), is each draft's chance for the
draft policy's cut. Attention sinks, a draft window and non-NeoX RoPE are refused in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["DSparkParams", "markov_walk", "read_dspark", "torch_heads"]


@dataclass(frozen=True)
class DSparkParams:
    """What a DSpark checkpoint adds to its DFlash backbone."""

    markov_rank: int
    confidence_head: bool
    confidence_with_markov: bool = True
    sample_from_anchor: bool = True
    own_embeddings: bool = False

    @property
    def offset(self) -> int:
        """The block position of the first proposal: 0 drafting from the anchor, else 1."""
        return 0 if self.sample_from_anchor else 1

    def param_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        """The weights DSpark adds to the DFlash ones of `cfg` (the `DFlashConfig` it belongs to)."""
        H, V, r = cfg.hidden_size, cfg.vocab_size, self.markov_rank
        out = {"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)}
        if self.confidence_head:
            width = H + r if self.confidence_with_markov else H
            out |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
        if self.own_embeddings:
            out["embed_tokens.weight"] = (V, H)
        return out


def _refusals(raw: Mapping[str, Any], dflash: Mapping[str, Any], where: str) -> None:
    why = None
    if dflash.get("projector_type", "dspark") != "dspark":
        why = f"dflash_config.projector_type {dflash.get('projector_type')!r} is not dspark"
    elif dflash.get("markov_head_type", "vanilla") != "vanilla":
        why = f"markov_head_type {dflash.get('markov_head_type')!r} is not read (vanilla only)"
    elif dflash.get("attention_sink_bias") or raw.get("attention_sink_bias"):
        why = "its attention sinks are not in the DFlash drafters' attention"
    elif dflash.get("draft_window_size") or raw.get("draft_window_size"):
        why = "a draft window over the context is not read"
    elif raw.get("rope_is_neox_style", True) is False:
        why = "interleaved (non-NeoX) RoPE is not read"
    elif raw.get("final_logit_softcapping") is not None:
        why = "a soft-capped read-out of its own is not read"
    if why:
        raise ValueError(f"{where}: {why}")


def read_dspark(folder: str | Path, raw: Mapping[str, Any]) -> Any:
    """The `DFlashConfig` (with `dspark`) of a DSpark checkpoint folder, its weights' names and shapes
    checked from the safetensors header. One line of ValueError otherwise."""
    from safetensors import safe_open

    from specdec.drafting.dflash.config import WEIGHTS_NAME, DFlashConfig, check_state_dict, require_file

    folder = Path(folder)
    where = f"DSpark checkpoint {str(folder)!r}"
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, Mapping):
        raise ValueError(f"{where}: needs a dflash_config object")
    _refusals(raw, dflash, where)
    gamma = dflash.get("block_size", raw.get("block_size"))
    rank = dflash.get("markov_rank", 256)
    if not isinstance(gamma, int) or gamma < 1 or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: block_size {gamma!r} and markov_rank {rank!r} must be positive integers")
    n = gamma - 1 if raw.get("dspark_bonus_anchor") else gamma  # proposals per block
    ids = dflash.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"{where}: dflash_config.target_layer_ids must name the target layers, got {ids!r}")
    known = isinstance(dflash.get("num_target_layers", raw.get("num_target_layers")), int)
    public = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "dflash_config")}
    public |= {
        "architectures": ["DFlashDraftModel"], "block_size": n + 1,
        "is_causal": bool(dflash.get("causal", False)),
        "num_target_layers": dflash.get("num_target_layers", raw.get("num_target_layers", max(ids) + 1)),
        "dflash_config": {"mask_token_id": dflash.get("mask_token_id"), "target_layer_ids": ids},
    }  # fmt: skip
    if "swa_window_size" in dflash:
        public["sliding_window"] = dflash["swa_window_size"]
    file = require_file(folder, WEIGHTS_NAME)
    try:
        with safe_open(str(file), framework="pt") as f:
            shapes = {k.removeprefix("model."): tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors' errors of a truncated or foreign file
        raise ValueError(f"cannot read {str(file)!r} (truncated or not safetensors): {e}") from None
    params = DSparkParams(
        markov_rank=rank,
        confidence_head=bool(dflash.get("enable_confidence_head", False)),
        confidence_with_markov=bool(dflash.get("confidence_head_with_markov", True)),
        sample_from_anchor=bool(dflash.get("sample_from_anchor", True)),
        own_embeddings="embed_tokens.weight" in shapes,
    )
    try:
        cfg = replace(DFlashConfig.from_dict(public), dspark=params, dialect="public" if known else "dspark")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    check_state_dict(cfg, shapes, source=str(file))
    return cfg


# ---- the heads, in PyTorch (the MLX drafter has its own) ---------------------------------------------------


def torch_heads(cfg: Any) -> Any:
    """The `markov_head` and `confidence_head` modules of a DSpark `cfg` (public parameter names)."""
    from torch import nn

    p = cfg.dspark
    markov = nn.Module()
    markov.markov_w1 = nn.Embedding(cfg.vocab_size, p.markov_rank)
    markov.markov_w2 = nn.Linear(p.markov_rank, cfg.vocab_size, bias=False)
    conf = None
    if p.confidence_head:
        conf = nn.Module()
        conf.proj = nn.Linear(
            cfg.hidden_size + (p.markov_rank if p.confidence_with_markov else 0), 1, bias=True
        )
    return markov, conf


def markov_walk(
    model: Any, hidden: Any, base: Any, anchor: int, *, temperature: float = 0.0, u: Any = None
) -> tuple[Any, Any, Any]:
    """The Markov head's walk over n proposals: hidden [n, H] and base logits [n, V] of the backbone ->
    (tokens [n], chances [n]: the confidence head's, else each step's top-1 probability; q [n, V] at
    temperature > 0, else None). Greedy, or sampled with uniforms u [n]. No host sync."""
    import torch

    from specdec.sampling import sample_from

    p = model.cfg.dspark
    prev = torch.tensor([anchor], device=base.device)
    tokens, chances, qs = [], [], []
    for i in range(base.shape[0]):
        e = model.markov_head.markov_w1(prev)  # [1, r]
        logits = (base[i : i + 1] + model.markov_head.markov_w2(e)).float()  # [1, V]
        if temperature > 0:
            qs.append((logits / temperature).softmax(-1))
            tok = sample_from(qs[-1], u[i : i + 1].to(logits.device))
        else:
            tok = logits.argmax(-1)
        if model.confidence_head is not None:
            x = torch.cat([hidden[i : i + 1], e], -1) if p.confidence_with_markov else hidden[i : i + 1]
            chances.append(torch.sigmoid(model.confidence_head.proj(x).float())[:, 0])
        else:
            chances.append(logits.softmax(-1).max(-1).values)
        tokens.append(tok)
        prev = tok
    q = torch.cat(qs) if qs else None
    return torch.cat(tokens), torch.cat(chances), q
