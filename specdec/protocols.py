"""The two interfaces the decode loop talks to, and the small types that cross them.

Contract in one paragraph: a `Verifier` owns the big model and its KV cache. `prefill` and `verify`
append tokens to the cache and return the verifier's own choice of next token after each position
(greedy argmax at temperature 0). `rollback(n)` removes the last n positions exactly. After each
`prefill`/`verify`, `features(n)` returns the captured outputs of the chosen decoder layers
(`target_layer_ids`, layer l = output of decoder layer l = HF `hidden_states[l+1]`) for the first n
positions of that call, concatenated over layers, as a torch tensor on the drafter's device.

A `Drafter` keeps an append-only context of those features (one row per verified position) and
proposes up to n tokens that follow the last committed token. Nothing here imports mlx or
transformers: runtimes live in `specdec.verifiers` / `specdec.bridges` and load lazily.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

#: A peak-memory reading: {"bytes": int | None, "source": str, "kind": str}. `bytes` is None when the
#: platform offers no honest reading; it is never a placeholder 0.
MemoryRecord = dict[str, Any]

#: ids [..., T] (int64) -> embeddings [..., T, H], exactly as the verifier embeds (scale included).
EmbedFn = Callable[[torch.Tensor], torch.Tensor]
#: hidden [..., H] -> logits [..., V], exactly as the verifier's head (final norm NOT included;
#: soft-capping included where the model has it).
LMHeadFn = Callable[[torch.Tensor], torch.Tensor]
#: logits [T, V] (torch, any float dtype/device) -> the verifier's token at each of the T positions.
#: Given at temperature > 0; the verifier calls it instead of taking the argmax.
SampleFn = Callable[[torch.Tensor], list[int]]


class RollbackError(RuntimeError):
    """`Verifier.rollback(n)` cannot remove those n positions exactly (e.g. a full sliding window no longer
    holds what it would have to restore). The cache is then in an unknown state: callers that can recover
    (prefix reuse, a stop-string cut) `reset()` and prefill again."""


def check_layer_ids(layer_ids: Sequence[int], num_layers: int, model_name: str) -> tuple[int, ...]:
    """`layer_ids` as a tuple, or ValueError naming the ones outside 0..num_layers-1."""
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"target layers {bad} out of range: {model_name} has 0..{num_layers - 1}")
    return tuple(layer_ids)


class MemoryProbe(Protocol):
    """Resets and reads a peak-memory counter around one call."""

    def reset(self) -> None: ...

    def read(self) -> MemoryRecord: ...


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class Verifier(Protocol):
    """The target model. Token lists returned by its methods double as synchronisation points."""

    runtime: str  # "stub" | "hf" | "mlx"
    model_name: str
    dtype: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_context: int  # positions the model can hold (prompt + output)
    eos_token_ids: frozenset[int]
    tokenizer: Tokenizer | None

    @property
    def position(self) -> int:
        """Number of positions held in the cache."""
        ...

    def set_target_layers(self, layer_ids: Sequence[int]) -> None:
        """Choose which decoder-layer outputs to capture (empty: capture nothing, the AR fast path)."""
        ...

    def check_rollback(self) -> None:
        """Raise RuntimeError (naming the cache/layer types) if this model cannot be rolled back exactly."""
        ...

    def reset(self) -> None: ...

    def prefill(self, tokens: Sequence[int], *, sample: SampleFn | None = None) -> int:
        """Append `tokens` to the cache; return the verifier's next token after the last one
        (argmax, or `sample(logits[1, V])[0]`)."""
        ...

    def verify(
        self, tokens: Sequence[int], *, sample: SampleFn | None = None, ahead: bool = False
    ) -> list[int]:
        """Append `tokens` in one forward; return the verifier's token after each of them
        (argmax, or `sample(logits[T, V])`). `ahead`: the caller will most likely pass the returned
        token back as the next call's only token (plain autoregressive decoding), so an asynchronous
        runtime may start that step before returning; no result may depend on it."""
        ...

    def rollback(self, n: int) -> None:
        """Drop the last `n` cached positions exactly (n may be 0). ValueError when n is out of range;
        `RollbackError` when it cannot be done exactly (every verifier uses that exception for it)."""
        ...

    def features(self, n: int, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[n, K*H] captured target features of the first n positions of the last call. A drafter may keep
        it past later calls (DFlash projects commits when it next proposes): never a view of a buffer the
        verifier writes again."""
        ...

    def embed_fn(self, *, device: torch.device, dtype: torch.dtype) -> EmbedFn: ...

    def lm_head_fn(
        self, *, device: torch.device, dtype: torch.dtype, rows: torch.Tensor | None = None
    ) -> LMHeadFn:
        """hidden [..., H] after the final norm -> logits [..., V] (softcap included); with `rows`
        (vocabulary ids [K], a drafter's draft vocabulary) logits [..., K] of those ids only."""
        ...

    def memory_probe(self) -> MemoryProbe: ...


@runtime_checkable
class Drafter(Protocol):
    """Proposes a block of tokens conditioned on verifier features of the committed context."""

    name: str
    block_size: int  # proposes at most block_size - 1 tokens per step
    target_layer_ids: tuple[int, ...]
    feature_dim: int  # K*H it expects per position; 0 if it needs no features
    vocab_size: int | None  # None: works with any vocabulary
    device: torch.device
    dtype: torch.dtype

    @property
    def context_len(self) -> int: ...

    def bind(self, verifier: Verifier) -> None:
        """Check compatibility with `verifier` (raise ValueError) and take its embed/lm_head callbacks."""
        ...

    def reset(self) -> None: ...

    def extend(self, features: torch.Tensor, tokens: Sequence[int]) -> None:
        """Append committed positions: features [n, K*H] and the n tokens at those positions."""
        ...

    def propose(self, last_token: int, n: int) -> list[int]:
        """Up to n tokens to follow `last_token` (which sits at position `context_len`)."""
        ...

    def rollback(self, n: int) -> None: ...

    def memory_probe(self) -> MemoryProbe: ...


def check_compatible(verifier: Verifier, drafter: Drafter) -> None:
    """Raise ValueError with the offending values when `drafter` cannot run against `verifier`."""
    ids = tuple(drafter.target_layer_ids)
    bad = [i for i in ids if not 0 <= i < verifier.num_layers]
    if bad:
        raise ValueError(
            f"drafter {drafter.name!r} asks for target layers {bad}, but the verifier "
            f"{verifier.model_name!r} has layers 0..{verifier.num_layers - 1}"
        )
    if drafter.feature_dim and drafter.feature_dim != len(ids) * verifier.hidden_size:
        raise ValueError(
            f"drafter {drafter.name!r} expects features of width {drafter.feature_dim}, but "
            f"{len(ids)} target layers x hidden size {verifier.hidden_size} of {verifier.model_name!r} "
            f"give {len(ids) * verifier.hidden_size}"
        )
    if drafter.vocab_size is not None and drafter.vocab_size != verifier.vocab_size:
        raise ValueError(
            f"drafter {drafter.name!r} has vocabulary size {drafter.vocab_size}, the verifier "
            f"{verifier.model_name!r} has {verifier.vocab_size}: the drafter was built for another model"
        )
