"""What a verifier measures about its own model on this machine, every verifier the same way.

- `verify_equals_steps`: a verify of up to MAX_VERIFY_TOKENS tokens gives each position bit for bit the
  logits one-token steps give (then speculative output equals autoregressive output exactly): one verify
  of MAX_VERIFY_TOKENS against calls of 1, 2, 3, 8, 15 and 32 tokens at the same positions (`PROBE_CHUNKS`,
  four one-token steps first), after a prompt whose keys cross an alignment boundary. Every row count a
  kernel may treat apart meets the large call's rows (torch's vectorised bf16 rsqrt, from 32 rows, showed
  here).
- `trees_equal_chains`: a tree verify gives every node bit for bit the logits of its path verified as a
  chain (`probe_tree`: branches at several depths after a prompt whose keys cross alignment blocks).

Both run through `Verifier.probe_logits(calls)`: the calls in order on a cache from empty (token lists
appended, an int rolled back, a `Tree` verified as one), each call's logits back as torch tensors; the
first call is the prompt, whose last row alone comes back (its other rows' LM head, a third of a probe on
a 262k vocabulary in emulated bf16, is never read).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import Any

import torch

from specdec.kernels import KEY_ALIGN, MAX_VERIFY_TOKENS, TreeAttention
from specdec.tree import Tree

__all__ = [
    "PROBE_CHUNKS",
    "PROBE_PARENTS",
    "PROBE_PROMPT",
    "probe_own_cache",
    "probe_tree",
    "trees_equal_chains",
    "verify_equals_steps",
]

#: the calls whose rows `verify_equals_steps` compares with one verify of MAX_VERIFY_TOKENS tokens
PROBE_CHUNKS = (1, 1, 1, 1, 2, 3, 8, 15, 32)
#: the probe tree's parents: branches at the root and at depths 1-3 (`probe_tree`)
PROBE_PARENTS = (-1, 0, 0, 0, 1, 1, 2, 4, 4, 7)
#: prompt tokens before the probe tree: its keys past a few alignment blocks
PROBE_PROMPT = 190


def probe_ids(vocab_size: int, n: int) -> list[int]:
    """n token ids spread over the vocabulary, the same on every machine."""
    return [(37 * i + 11) % vocab_size for i in range(n)]


def probe_tree(vocab_size: int) -> tuple[list[int], Tree]:
    """The prompt and the tree (`PROBE_PARENTS`) a verifier measures its tree verify with."""
    ids = probe_ids(vocab_size, PROBE_PROMPT + len(PROBE_PARENTS))
    return ids[:PROBE_PROMPT], Tree(ids[PROBE_PROMPT:], list(PROBE_PARENTS))


def verify_equals_steps(verifier: Any, *, n_prompt: int = KEY_ALIGN - 4) -> bool:
    """Whether a verify of MAX_VERIFY_TOKENS tokens gives bit for bit the logits that calls of the sizes of
    `PROBE_CHUNKS` give at the same positions, on `verifier`'s own model here (module docstring)."""
    assert sum(PROBE_CHUNKS) == MAX_VERIFY_TOKENS
    ids = probe_ids(verifier.vocab_size, n_prompt + MAX_VERIFY_TOKENS)
    prompt, block = ids[:n_prompt], ids[n_prompt:]
    whole = verifier.probe_logits([prompt, block])[1]  # [MAX_VERIFY_TOKENS, V]
    chunks: Sequence[list[int]] = [block[i:j] for i, j in pairwise(accumulate(PROBE_CHUNKS, initial=0))]
    parts = verifier.probe_logits([prompt, *chunks])[1:]
    return torch.equal(whole, torch.cat(parts))


def trees_equal_chains(verifier: Any) -> bool:
    """Whether a tree verify gives every node bit for bit the logits of its path verified as a chain, on
    `verifier`'s own model here (`probe_tree`)."""
    prompt, tree = probe_tree(verifier.vocab_size)
    calls: list[Any] = [prompt]
    for i in range(len(tree)):
        path = tree.path(i)
        calls += [[tree.tokens[j] for j in path], len(path)]  # the path as a chain, then rolled back
    out = verifier.probe_logits([*calls, tree])
    got = out[-1]  # [N, V]
    return all(torch.equal(got[i], out[1 + 2 * i][-1]) for i in range(len(tree)))


def probe_own_cache(
    verifier: Any, calls: Sequence[Any], device: torch.device | str
) -> list[torch.Tensor | None]:
    """`probe_logits` for a torch verifier that measures at load, on its own cache from empty (left reset):
    its `forward(tokens, tree=TreeAttention)`, `rollback` and `reset`."""
    verifier.set_target_layers(())
    verifier.reset()
    out: list[torch.Tensor | None] = []
    for i, call in enumerate(calls):
        if isinstance(call, int):
            verifier.rollback(call)
            out.append(None)
        elif isinstance(call, Tree):
            out.append(
                verifier.forward(call.tokens, tree=TreeAttention(call, verifier.position, device))
            )  # [N, V]
        else:
            out.append(verifier.forward(call, last_only=i == 0))  # [T, V]; the prompt's [1, V]
    verifier.reset()
    return out
