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

What some verifiers or drafters can also do is declared here too, as protocols of their own that callers
test with `isinstance`: `NativeFeatures` (features in the verifier's own arrays, for a drafter of its
runtime), `SampledProposals` (a drafter's logits, for sampled drafts at T > 0), `SampledWalk` (a drafter
that samples a walk of dependent drafts itself), `TreeVerify` / `TreeProposals` (tree verification,
`specdec.tree`), `SharedKV` (the keys / values of its attention layers, for a Gemma-4 assistant),
`BatchedCalls` (its calls share forwards with other sequences'),
`Describes` (what the result JSON records about it), `BatchFeatures` and `BatchGeneration` (what
training uses when a verifier has them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from specdec.tree import Tree, TreeBudget

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


def check_call(n: int, position: int, max_context: int) -> None:
    """A verifier call of `n` tokens after `position` cached ones fits `max_context`, or ValueError."""
    if n == 0:
        raise ValueError("no tokens to process")
    if position + n > max_context:
        raise ValueError(f"context overflow: {position} cached + {n} new > max_context {max_context}")


#: one call of `Verifier.probe_logits`: token ids appended, a number of positions rolled back, or a tree
#: verified in one call
ProbeCall = Sequence[int] | int | Tree


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
    #: a verify of several tokens gives each position bit for bit the logits one-token steps give, on
    #: this model here (measured at load; speculative output then equals autoregressive output exactly)
    batch_invariant: bool
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

    def probe_logits(self, calls: Sequence[ProbeCall]) -> list[torch.Tensor | None]:
        """Run `calls` in order on a cache from empty and return each call's logits [T, V] as torch tensors
        (None for a rollback; the first call, a prompt, gives its last row's alone, [1, V]): how
        `specdec.measure` measures `batch_invariant` and `tree_exact` on every verifier the same way. A
        verifier that measures at load may use its own cache (leaving it reset); one that measures on first
        use must leave its cache as it was."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """Proposes a block of tokens conditioned on verifier features of the committed context."""

    name: str
    runtime: str  # whose arrays its features arrive as: "torch", or a verifier runtime's ("mlx")
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


@runtime_checkable
class NativeFeatures(Protocol):
    """A verifier that hands features as its own runtime's arrays (no conversion) to a drafter of that
    runtime (`Drafter.runtime == Verifier.runtime`)."""

    def native_features(self, n: int) -> Any:
        """`features(n)` as this runtime's array [n, K*H]."""
        ...


@runtime_checkable
class SampledProposals(Protocol):
    """A drafter whose proposals come from logits it can give, so drafts can be sampled at T > 0
    (`--proposal sample`); others are verified as point-mass drafts."""

    def propose_logits(self, last_token: int, n: int) -> torch.Tensor:
        """Logits [n, V] of the next n positions after `last_token`."""
        ...


@runtime_checkable
class SampledWalk(Protocol):
    """A drafter whose each draft depends on the one it drew before (DFlash2's candidate walk, `walks`
    True): at T > 0 with `--proposal sample` it draws the walk itself from the engine's uniforms."""

    walks: bool

    def propose_walk(
        self, last_token: int, n: int, *, temperature: float, u: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """n tokens after `last_token` drawn with uniforms u [n], and q [n, V]: row i the distribution
        token i was drawn from, given tokens 0..i-1 (what the `rejection` rule verifies against)."""
        ...


@runtime_checkable
class TreeVerify(Protocol):
    """A verifier that verifies a tree of drafts in one call (`specdec.tree`)."""

    def check_tree(self) -> None:
        """Raise ValueError (one line, naming why) where this model cannot verify trees exactly (the
        verifiers measure it with `specdec.measure.trees_equal_chains` and keep it as `tree_exact`)."""
        ...

    def verify_tree(self, tree: Tree, *, sample: SampleFn | None = None) -> list[int]:
        """Append the tree's nodes in one forward, node i at position `position + depth[i]` seeing the cache
        and its own ancestors only; return the verifier's token after each node (argmax, or
        `sample(logits[N, V])`)."""
        ...

    def keep_path(self, path: Sequence[int]) -> None:
        """After `verify_tree`: keep exactly the nodes `path` (root first, each the parent of the next) as
        the newest cached positions, in that order, and drop the other nodes; `features(n)` and `rollback`
        then see those positions as if the path had been verified as a chain."""
        ...


@runtime_checkable
class TreeProposals(Protocol):
    """A drafter that proposes a tree (`--tree`): its candidates at each block position, best first."""

    def propose_tree(self, last_token: int, depth: int, budget: TreeBudget) -> Tree:
        """A tree rooted at `last_token` of at most `depth` levels below it, within `budget`."""
        ...


@runtime_checkable
class FinalNorm(Protocol):
    """A verifier that hands its final norm, so a drafter reading its last decoder layer's output sees
    what the verifier's LM head reads (Medusa heads)."""

    def final_norm_fn(
        self, *, device: torch.device, dtype: torch.dtype
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """hidden [..., H] -> normed [..., H] in `dtype` on `device`, computed as the model computes it."""
        ...


@runtime_checkable
class SharedKV(Protocol):
    """A verifier that hands a drafter the keys and values its attention layers hold for the committed
    positions (a Gemma-4 assistant attends over the target's own K/V and has no cache of its own)."""

    def keep_window(self, n: int) -> None:
        """Keep at least the n most recent positions in every sliding-window layer, also across rollbacks
        (the layer needs fewer itself); applies to the cache from now on."""
        ...

    def shared_kv(self, layer: int, *, last: int | None = None) -> tuple[Any, Any]:
        """Keys and values [1, H_kv, T, D] of decoder layer `layer` (post-norm, post-RoPE, as its attention
        reads them) for the cached positions, or the `last` most recent of them; the verifier's own arrays,
        views where the runtime has them (no copy of the cache), valid until its next call."""
        ...


@runtime_checkable
class BatchedCalls(Protocol):
    """A verifier whose calls run in forwards shared with other sequences' (a sequence of a batch:
    `specdec.batch.batch_of`)."""

    #: how many sequences' calls the forward of its last call ran (1: alone)
    batch_size: int

    def member(self) -> AbstractContextManager[None]:
        """While a run decodes on it: the batch's other members' calls wait for its next one (and its for
        theirs), so they share forwards. `engine.decode` holds it for the run."""
        ...

    def parked(self) -> AbstractContextManager[None]:
        """While its run's consumer has control (`engine.decode` holds it at each yield): the others'
        calls do not wait for its next one, so a stream nobody iterates holds nobody up."""
        ...


@runtime_checkable
class Describes(Protocol):
    """A drafter that says what the result JSON's `config.drafter` records about it beyond the protocol's
    fields: e.g. `path`, `min_confidence`, `costs`, `corpus`, `proposals`."""

    def describe(self) -> dict[str, Any]: ...


@runtime_checkable
class BatchFeatures(Protocol):
    """A verifier that computes teacher-forced features of a batch (training's online features)."""

    def batch_features(
        self, ids: torch.Tensor, layer_ids: Sequence[int], *, topk: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]: ...


@runtime_checkable
class BatchGeneration(Protocol):
    """A verifier that answers many prompts greedily at once (building a training corpus)."""

    def generate_many(self, items: Any, *, max_len: int, rows: int = 128) -> Any: ...


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
