"""Greedy answers to many prompts at once, for training data: continuous batching over a transformers
model (what `HFVerifier.generate_many` runs; `specdec.train.corpus` builds corpora with it). It lives
with the HF verifier: training sits above the verifiers, never below them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["generate_many"]


class _RowCache:
    """A duck-typed transformers `Cache` for continuous batching: per layer one [R, nkv, S, D] buffer, row r
    holding its sequence at slots 0..len_r-1 (slot = position). A prefill writes the rows in `rows` from
    slot 0 and attends to its own keys; a decode step writes every row at its own slot `slots[r]` and
    attends to the first `width` slots under the caller's mask."""

    def __init__(self, n_rows: int, n_slots: int) -> None:
        self.n_rows, self.n_slots = n_rows, n_slots
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.rows: torch.Tensor | None = None  # [b] rows of a prefill; None: a decode step of all rows
        self.slots = torch.zeros(n_rows, 1, dtype=torch.long)  # [R, 1] decode write slot per row
        self.width = 1

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, **kw: Any) -> tuple[torch.Tensor, ...]:
        if layer_idx not in self.k:  # [R, nkv, S, D], allocated on first use (head dims may differ)
            shape = (self.n_rows, k.shape[1], self.n_slots, k.shape[3])
            self.k[layer_idx] = k.new_zeros(shape)
            self.v[layer_idx] = v.new_zeros(shape)
        K, V = self.k[layer_idx], self.v[layer_idx]
        if self.rows is not None:  # prefill: k, v [b, nkv, T, D] are the rows' whole keys
            T = k.shape[2]
            K[self.rows, :, :T] = k
            V[self.rows, :, :T] = v
            return k, v
        r = torch.arange(self.n_rows, device=k.device)[:, None]  # [R, 1]
        K[r, :, self.slots] = k.transpose(1, 2)  # [R, 1, nkv, D] into slot slots[r]
        V[r, :, self.slots] = v.transpose(1, 2)
        return K[:, :, : self.width], V[:, :, : self.width]


def _masks(model: torch.nn.Module, q_pos: torch.Tensor, k_pos: torch.Tensor, valid: torch.Tensor) -> Any:
    """The attention mask(s) a transformers model takes for query positions [B, T] over key slots [S]:
    causal, `valid` [B, S] keys, and the sliding window on sliding layers (a dict per layer type when the
    model has several)."""
    cfg = model.config.get_text_config(decoder=True)
    rel = q_pos[:, :, None] - k_pos[None, None, :]  # [B, T, S]
    full = ((rel >= 0) & valid[:, None, :])[:, None]  # [B, 1, T, S]
    types = set(getattr(cfg, "layer_types", None) or ())
    if not types:
        return full
    window = getattr(cfg, "sliding_window", None)
    out = {t: full for t in types}
    if "sliding_attention" in types and window:
        out["sliding_attention"] = full & (rel < window)[:, None]
    return out


def _length_groups(items: list[Any], size: Callable[[Any], int], slack: float = 1.25) -> Iterator[list[Any]]:
    """Consecutive groups of `items` (sorted by `size`) whose padded size is at most `slack` x their sum."""
    group: list[Any] = []
    for x in items:
        if group and (len(group) + 1) * size(x) > slack * (sum(map(size, group)) + size(x)):
            yield group
            group = []
        group.append(x)
    if group:
        yield group


def _prefill_rows(
    model: torch.nn.Module, cache: _RowCache, rows: list[int], prompts: list[list[int]]
) -> list[int]:
    """Prefill `prompts` into cache rows `rows` from slot 0 (right-padded: pads sit after each prompt and
    are never seen); the greedy first token of each."""
    dev = cache.slots.device
    L = max(map(len, prompts))
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, : len(p)] = torch.tensor(p)
    pos = torch.arange(L, device=dev)[None].expand(len(prompts), L)  # [b, L]
    cache.rows = torch.tensor(rows, device=dev)
    mask = _masks(model, pos, pos[0], torch.ones(len(prompts), L, dtype=torch.bool, device=dev))
    try:
        h = model.model(
            input_ids=ids.to(dev), position_ids=pos, attention_mask=mask, cache=cache, use_cache=True
        ).last_hidden_state  # [b, L, H]
    finally:
        cache.rows = None
    ends = torch.tensor([len(p) - 1 for p in prompts], device=dev)
    return model.lm_head(h[torch.arange(len(prompts), device=dev), ends]).argmax(-1).tolist()


@torch.inference_mode()
def generate_many(
    model: torch.nn.Module,
    items: Iterable[tuple[Any, Sequence[int], int]],
    *,
    stop_ids: frozenset[int],
    rows: int = 128,
    max_len: int,
) -> Iterator[tuple[Any, list[int]]]:
    """Greedy responses to (key, prompt ids, budget) items, yielded as (key, response) as each ends: up
    to `budget` tokens, ending at the first stop id (included). Continuous batching: `rows` sequences
    decode together and a finished row takes the next item, so no row idles until the longest answer of a
    batch ends (as in `model.generate`, which wastes ~40% of its steps on training prompts). Free rows are
    refilled in one prefill once an eighth of them (or all, at the end) are free. The model's own code,
    positions and masks, row by row as in a one-prompt greedy decode; tested token for token against
    `model.generate`. `max_len` bounds prompt + budget (the cache holds that many slots per row)."""
    dev = next(model.parameters()).device
    todo = iter(items)
    pending: list[tuple[Any, list[int], int]] = []
    cache = _RowCache(rows, max_len)
    who: list[tuple[Any, list[int], int] | None] = [None] * rows  # (key, response so far, budget) per row
    length = torch.zeros(rows, dtype=torch.long)  # [R] tokens in each row's cache
    nxt = torch.zeros(rows, dtype=torch.long)  # [R] next input token per row
    slots = torch.arange(max_len, device=dev)

    def fill(n: int) -> None:
        while len(pending) < n and (item := next(todo, None)) is not None:
            key, prompt, budget = item
            if len(prompt) < 1 or budget < 1 or len(prompt) + budget > max_len:
                raise ValueError(
                    f"item {key!r}: prompt of {len(prompt)} + budget {budget} must fit {max_len}"
                )
            pending.append((key, list(prompt), int(budget)))

    def commit(r: int, tok: int) -> tuple[Any, list[int]] | None:
        key, resp, budget = who[r]
        resp.append(tok)
        if tok in stop_ids or len(resp) >= budget:
            who[r] = None
            return key, resp
        return None

    while True:
        free = [r for r in range(rows) if who[r] is None]
        fill(len(free))
        if pending and free and (len(free) >= max(1, rows // 8) or len(pending) < len(free)):
            take = sorted(zip(free, pending), key=lambda x: len(x[1][1]))  # (row, item), shortest first
            del pending[: len(take)]
            for group in _length_groups(take, lambda x: len(x[1][1])):
                first = _prefill_rows(model, cache, [r for r, _ in group], [p for _, (_, p, _) in group])
                for (r, (key, p, budget)), t in zip(group, first):
                    who[r], length[r], nxt[r] = (key, [], budget), len(p), t
                    if (done := commit(r, t)) is not None:
                        yield done
            continue
        busy = torch.tensor([w is not None for w in who])  # [R]
        if not busy.any():
            return
        cur = torch.where(busy, length, 0)  # [R] write slot = position; free rows scribble on slot 0
        cache.slots, cache.width = cur[:, None].to(dev), int(cur.max()) + 1
        valid = slots[None, : cache.width] <= cache.slots  # [R, width]
        mask = _masks(model, cache.slots, slots[: cache.width], valid)
        h = model.model(
            input_ids=nxt[:, None].to(dev),
            position_ids=cache.slots,
            attention_mask=mask,
            cache=cache,
            use_cache=True,
        ).last_hidden_state  # [R, 1, H]
        # soft-capping is monotonic, so the head's argmax is the model's greedy token
        nxt = model.lm_head(h[:, 0]).argmax(-1).cpu()  # [R]: the one host sync of a step
        length += 1
        for r in busy.nonzero()[:, 0].tolist():
            if (done := commit(r, int(nxt[r]))) is not None:
                yield done
