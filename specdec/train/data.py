"""Training data: the sequences of a corpus, their anchors, and batches of them.

Anchors are drawn per sequence (at most `max_anchors`) only where the whole block of labels lies in the
response: anchor a needs prompt_len - 1 <= a <= length - block_size (an anchor on the last prompt token is
the bonus token a real first step starts from). Batches and anchors come from generators seeded by
(seed, epoch) and (seed, step, sequence), so runs are deterministic and a resumed run continues exactly
as an uninterrupted one. Batches group sequences of similar length (within windows of 32 batches of a
seeded shuffle), so little of a batch is padding.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.corpus import Corpus, TrainSequence
from specdec.train.features import TargetFeatures

__all__ = ["Batch", "TrainData", "anchor_range", "collate", "draft_vocabulary", "sample_anchors", "seed_of"]


def seed_of(*parts: int) -> int:
    """A stable 63-bit seed from integers (FNV-1a style; Python's hash is not used)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p % (1 << 48))) * 1099511628211) % (1 << 63)
    return h


class TrainData:
    """The finished sequences of a corpus' stages (all when None), in corpus order."""

    def __init__(
        self,
        corpus_dir: str | os.PathLike[str],
        *,
        stages: Sequence[str] | None = None,
        max_sequences: int | None = None,
    ) -> None:
        self.corpus = Corpus(corpus_dir)
        self.path = Path(corpus_dir)
        have = list(self.corpus.meta["stages"])
        self.stages = tuple(stages) if stages is not None else tuple(have)
        missing = [s for s in self.stages if s not in have]
        if missing:
            raise ValueError(f"corpus {str(self.path)!r} has no stages {missing} (it has {have})")
        self.sequences: list[TrainSequence] = [s for st in self.stages for s in self.corpus.sequences(st)]
        if max_sequences is not None:
            self.sequences = self.sequences[:max_sequences]
        self.verifier: dict[str, Any] = self.corpus.meta["verifier"]

    def __len__(self) -> int:
        return len(self.sequences)


def anchor_range(prompt_len: int, length: int, block_size: int) -> tuple[int, int]:
    """[lo, hi] of the anchors whose block labels all lie in the response (empty when lo > hi)."""
    return max(prompt_len - 1, 0), length - block_size


def sample_anchors(
    prompt_len: int,
    length: int,
    block_size: int,
    max_anchors: int,
    seed: int,
    *,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sorted anchor positions [A], A = min(max_anchors, valid positions), drawn without replacement:
    uniformly, or in proportion to `weights` [length] (the weight of each position as an anchor)."""
    lo, hi = anchor_range(prompt_len, length, block_size)
    n = hi - lo + 1
    if n <= 0:
        return torch.zeros(0, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    if weights is None:
        pick = torch.randperm(n, generator=g)[: min(max_anchors, n)]
    else:
        pick = torch.multinomial(weights[lo : hi + 1].double(), min(max_anchors, n), generator=g)
    return (pick + lo).sort().values


def batch_order(lengths: Sequence[int], batch_size: int, seed: int) -> list[list[int]]:
    """One epoch of batches of indices into `lengths`: a seeded shuffle, cut into windows of 32 batches
    sorted by length, then the batches in a seeded order (a tail shorter than batch_size is dropped)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    window = 32 * batch_size
    batches = []
    for w in range(0, len(perm) - batch_size + 1, window):
        part = sorted(perm[w : w + window], key=lambda i: (lengths[i], i))
        batches += [part[j : j + batch_size] for j in range(0, len(part) - batch_size + 1, batch_size)]
    order = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in order]


@dataclass
class Batch:
    """One process's share of a step: sequences padded to a common length, anchors padded per sequence."""

    ids: torch.Tensor  # [B, T] int64
    features: torch.Tensor  # [B, T, K*H]
    anchors: torch.Tensor  # [B, A] int64 (padding: 0)
    valid: torch.Tensor  # [B, A] bool
    topk_logp: torch.Tensor | None = None  # [B, T, k] verifier log-probs of the token after each position
    topk_ids: torch.Tensor | None = None  # [B, T, k]


def collate(
    data: TrainData,
    idx: Sequence[int],
    anchors: Sequence[torch.Tensor],
    *,
    features: TargetFeatures,
    device: torch.device,
) -> Batch:
    """Pad sequences `idx` of `data` and their anchors; their features come from the verifier."""
    seqs = [data.sequences[i] for i in idx]
    T = max(len(s.ids) for s in seqs)
    A = max(1, *(len(a) for a in anchors))
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    anc = torch.zeros(len(seqs), A, dtype=torch.long)
    valid = torch.zeros(len(seqs), A, dtype=torch.bool)
    for b, (s, a) in enumerate(zip(seqs, anchors)):
        ids[b, : len(s.ids)] = torch.from_numpy(s.ids.astype(np.int64))
        anc[b, : len(a)] = a
        valid[b, : len(a)] = True
    feats, lp, ti = features(ids, [len(s.ids) for s in seqs], device=device)
    return Batch(ids.to(device), feats, anc.to(device), valid.to(device), lp, ti)


def draft_vocabulary(data: TrainData, seqs: Sequence[int], k: int, mask_token_id: int) -> torch.Tensor:
    """[k] int64: the vocabulary ids the verifier writes most often in the responses of `seqs`, then the
    most frequent prompt ids, then the lowest ids (BPE merges come roughly in frequency order); never
    the mask token. Ties break towards the lower id, so the choice is deterministic."""
    V = int(data.verifier["vocab_size"])
    resp = np.zeros(V, dtype=np.float64)
    prompt = np.zeros(V, dtype=np.float64)
    for i in seqs:
        s = data.sequences[i]
        resp += np.bincount(s.ids[s.prompt_len :], minlength=V)
        prompt += np.bincount(s.ids[: s.prompt_len], minlength=V)
    resp[mask_token_id] = prompt[mask_token_id] = -1.0
    order = torch.arange(V)  # lexicographic by stable sorts, least significant key first
    for key in (torch.from_numpy(prompt), torch.from_numpy(resp)):
        order = order[key[order].argsort(descending=True, stable=True)]
    return order[:k].sort().values
