"""The training loss: every anchor block of a batch through `DFlashDraftModel.anchor_blocks`, chunk by chunk,
the loss inside each chunk.

Cross-entropy on block positions k = 1..bs-1 weighted by exp(-(k-1)/gamma), summed (the caller divides by
the weight sum of the global batch); the anchor position is not supervised. With `kl_weight` > 0 the loss
adds KL(p || q): p is the verifier's distribution of the token at a+k (its logits at a+k-1, as top-k
log-probs renormalised over the top k), q the drafter's. Anchor blocks run `attn_chunk` at a time, each
chunk under activation checkpointing with its loss computed inside, so neither the attention nor the
logits of all anchors coexist, forward or backward. The embedding and LM head are frozen callbacks.
"""

from __future__ import annotations

from typing import Any

import torch

from specdec.protocols import EmbedFn, LMHeadFn
from specdec.train.data import Batch

__all__ = ["block_loss", "default_gamma", "position_weights", "repeats"]


def default_gamma(block_size: int) -> float:
    """The paper's loss decay: 7 for bs 16, 5 for 10, 4 for 8; bs/2 up to 10 and 5 + (bs-10)/3 above."""
    return block_size / 2 if block_size <= 10 else 5 + (block_size - 10) / 3


def position_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """[bs-1] loss weights exp(-(k-1)/gamma) of block positions k = 1..bs-1."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def repeats(ids: torch.Tensor, n: int = 3) -> torch.Tensor:
    """ids [B, T] -> [B, T] bool: where the token repeats earlier text, i.e. the n tokens before it occurred
    earlier in the sequence and were followed by this same token there (what prompt lookup would draft)."""
    out = torch.zeros(ids.shape, dtype=torch.bool)
    for b, seq in enumerate(ids.tolist()):
        after: dict[tuple[int, ...], int] = {}  # n-gram -> the token that followed its latest occurrence
        for t in range(n, len(seq)):
            key = tuple(seq[t - n : t])
            out[b, t] = after.get(key) == seq[t]
            after[key] = seq[t]
    return out.to(ids.device)


def _head_rows(lm_head_fn: LMHeadFn, h: torch.Tensor) -> torch.Tensor:
    """The head over h [..., H] as one contiguous 2-D product (a strided 4-D input makes torch.matmul
    expand the weight into a batched product: measured 1.8x slower for the whole training step)."""
    return lm_head_fn(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], -1)


def _draft_columns(rows: torch.Tensor | None, vocab_size: int, dev: torch.device) -> torch.Tensor | None:
    """[V] the logit column of each vocabulary id where the head reads out a draft vocabulary `rows` [K]
    only (`lm_head_fn` gives those ids' logits), -1 outside it; None for the whole vocabulary."""
    if rows is None:
        return None
    col_of = torch.full((vocab_size,), -1, dtype=torch.long, device=dev)
    col_of[rows] = torch.arange(len(rows), device=dev)
    return col_of


def block_loss(
    model: Any,
    batch: Batch,
    embed_fn: EmbedFn,
    lm_head_fn: LMHeadFn,
    *,
    gamma: float,
    attn_chunk: int | None = None,
    kl_weight: float = 0.0,
    checkpoint: bool = True,
    repeat_weight: float = 1.0,
) -> dict[str, torch.Tensor]:
    """The weighted loss SUM and detached statistics of one batch: {"loss_sum", "weight_sum", "correct",
    "count", "accept_sum", "n_anchors"}: top-1 `correct` of `count` supervised positions, `accept_sum`
    the sum over anchors of 1 + the leading run of correct positions (teacher-forced acceptance length).
    `repeat_weight` multiplies the loss weight of positions whose token repeats earlier text (`repeats`)."""
    cfg = model.cfg
    bs, dev, mask_id = cfg.block_size, batch.ids.device, cfg.mask_token_id
    T, A = batch.ids.shape[1], batch.anchors.shape[1]
    posw = position_weights(bs, gamma, dev)  # [bs-1]
    offs = torch.arange(1, bs, device=dev)  # [bs-1]
    col_of = _draft_columns(getattr(model, "draft_vocab", None), cfg.vocab_size, dev)  # [V] or None
    mask_col = mask_id if col_of is None else int(col_of[mask_id])
    ctx = model.project(batch.features.to(model.dtype))  # [B, T, H]
    ctx_kv = model.context_kv(ctx, torch.arange(T, device=dev)[None])  # per layer [B, nkv, T, D]
    flat_kv = [t for pair in ctx_kv for t in pair]
    # [B, T] loss weight of each position's token: repeat_weight where it repeats earlier text
    tok_w = 1.0 + (repeat_weight - 1.0) * repeats(batch.ids).float() if repeat_weight != 1.0 else None

    def run(anc: torch.Tensor, valid: torch.Tensor, *kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blk = torch.full((*anc.shape, bs), mask_id, dtype=batch.ids.dtype, device=dev)
        blk[:, :, 0] = torch.gather(batch.ids, 1, anc)  # [B, C, bs]: [x_anchor, MASK...]
        hidden = model.anchor_blocks(list(zip(kv[0::2], kv[1::2])), anc, embed_fn(blk))  # [B, C, bs, H]
        logits = _head_rows(lm_head_fn, hidden[:, :, 1:]).float()  # [B, C, bs-1, K or V]
        tpos = (anc[:, :, None] + offs).clamp(max=T - 1)  # [B, C, bs-1] label positions a+k
        labels = torch.gather(batch.ids, 1, tpos.flatten(1)).view_as(tpos)  # [B, C, bs-1]
        known = valid[:, :, None].expand_as(labels)  # [B, C, bs-1] supervised positions
        if col_of is not None:  # labels outside the draft vocabulary cannot be drafted: no loss, wrong
            labels = col_of[labels]
            known = known & (labels >= 0)
            labels = labels.clamp(min=0)
        logp = torch.log_softmax(logits, -1)
        w = known.float() * posw  # [B, C, bs-1]
        if tok_w is not None:
            w = w * torch.gather(tok_w, 1, tpos.flatten(1)).view_as(tpos)
        loss = (-logp.gather(-1, labels[..., None]).squeeze(-1) * w).sum()
        if kl_weight > 0:
            loss = loss + kl_weight * (_kl(batch, tpos, logp) * w).sum()
        with torch.no_grad():
            pred = logits.detach()
            if 0 <= mask_col < pred.shape[-1]:  # never proposed at inference
                pred = pred.index_fill(-1, torch.tensor([mask_col], device=dev), float("-inf"))
            ok = (pred.argmax(-1) == labels) & known  # [B, C, bs-1]
            run_len = torch.cumprod(ok.long(), -1).sum(-1)  # [B, C] leading correct positions
            n = valid.sum().float()
            stats = torch.stack([ok.sum().float(), n * (bs - 1), ((run_len + 1) * valid).sum().float(), n])
        return loss, stats

    chunk = attn_chunk or A
    loss_sum, stats = torch.zeros((), device=dev), torch.zeros(4, device=dev)
    use_ckpt = checkpoint and chunk < A and torch.is_grad_enabled()
    for c0 in range(0, A, chunk):
        args = (batch.anchors[:, c0 : c0 + chunk], batch.valid[:, c0 : c0 + chunk], *flat_kv)
        if use_ckpt:
            from torch.utils.checkpoint import checkpoint as ckpt

            loss, st = ckpt(run, *args, use_reentrant=False)
        else:
            loss, st = run(*args)
        loss_sum, stats = loss_sum + loss, stats + st
    return {
        "loss_sum": loss_sum,
        "weight_sum": batch.valid.float().sum() * posw.sum(),
        "correct": stats[0],
        "count": stats[1],
        "accept_sum": stats[2],
        "n_anchors": stats[3],
    }


def _kl(batch: Batch, tpos: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) [B, C, bs-1]: p the verifier's top-k distribution of the token at each label position
    (its logits one position earlier), renormalised over the top k; q the drafter's `logp`."""
    assert batch.topk_logp is not None and batch.topk_ids is not None
    k = batch.topk_logp.shape[-1]
    src = (tpos - 1).flatten(1)[..., None].expand(-1, -1, k)
    t_logp = torch.gather(batch.topk_logp, 1, src).view(*tpos.shape, k).float()
    t_ids = torch.gather(batch.topk_ids, 1, src).view(*tpos.shape, k).long()
    p_logp = torch.log_softmax(t_logp, -1)
    return (p_logp.exp() * (p_logp - logp.gather(-1, t_ids))).sum(-1)
