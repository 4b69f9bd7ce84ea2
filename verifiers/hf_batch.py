"""Several sequences on one loaded HF model, their calls verified together in one forward.

`HFBatch(verifier)` hands out `HFSequence`s: each the Verifier protocol with a KV cache of its own, sharing
the model, its tokenizer and what was measured when it loaded. While sequences are members of the batch
(`member`, what `specdec.batch` holds around a request's run), a call of one (`prefill`, `verify`) waits
until every member has one waiting; then one forward runs them: their tokens packed into one row
sequence [1, sum T], each at its own positions, every linear computing all rows in one product, and
attention computed per sequence over its own cache (`hf_parts.attend_packed`). A call of more than
`MAX_VERIFY_TOKENS` tokens (a long prefill) runs alone, and calls are grouped so no forward holds more
rows than that.

Exact, or refused: each sequence gets bit for bit the logits its call alone gets where the model's rows do
not depend on the rows beside them: `HFVerifier.batch_invariant` (the linears up to `MAX_VERIFY_TOKENS`
rows and the invariant attention, measured on the loaded model at load) and, measured here once more on
the model, packed calls against the same calls alone (`packed_equals_solo`). A model or machine where that
does not hold, and models with layers the packed attention does not cover yet (sliding windows, KV-shared
or linear-attention layers, attention sinks), get a one-line ValueError: their requests run one at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from specdec.kernels import MAX_VERIFY_TOKENS
from specdec.protocols import check_layer_ids
from specdec.verifiers.hf import HFVerifier
from specdec.verifiers.hf_parts import PACK, Packed, packed_layer

__all__ = ["HFBatch", "HFSequence"]


class HFSequence(HFVerifier):
    """One sequence of an `HFBatch`: an `HFVerifier` with its own cache whose calls go through the batch."""

    def __init__(self, batch: HFBatch) -> None:  # the loaded verifier's state, not its loading
        self.__dict__.update(batch.base.__dict__)
        self.batch = batch
        self.batch_size = 1  # `BatchedCalls`: the calls the forward of its last call ran
        self._hooks, self._captured, self._layer_ids = [], {}, ()
        self.reset()

    def set_target_layers(self, layer_ids: Sequence[int]) -> None:
        self._layer_ids = check_layer_ids(layer_ids, self.num_layers, self.model_name)  # the batch hooks them

    def check_tree(self) -> None:
        raise ValueError(f"{self.model_name}: a sequence verified in a batch verifies chains; use a chain")

    def forward(self, tokens: Sequence[int], *, last_only: bool = False, tree: Any = None) -> torch.Tensor:
        if tree is not None:
            self.check_tree()
        self._check_call(tokens)
        return self.batch.call(self, list(tokens), last_only)


class HFBatch:
    """Sequences on one loaded `HFVerifier` whose calls are verified together (module docstring)."""

    def __init__(self, verifier: HFVerifier) -> None:
        why = _unsupported(verifier)
        if why:
            raise ValueError(f"{verifier.model_name} cannot verify several sequences in one forward: {why}")
        self.base = verifier
        self._cond = threading.Condition()
        self._members: set[HFSequence] = set()
        self._waiting: dict[HFSequence, list[Any]] = {}  # in arrival order: [tokens, last_only, logits]
        self.sizes: list[int] = []  # the calls of each forward run, in order (what benchmarks read)
        if not packed_equals_solo(self):
            raise ValueError(
                f"{verifier.model_name} cannot verify several sequences in one forward: its packed rows do "
                f"not give the logits of the same calls alone here in {verifier.dtype} (measured)"
            )

    def sequence(self) -> HFSequence:
        return HFSequence(self)

    @contextmanager
    def member(self, seq: HFSequence) -> Iterator[None]:
        """`seq` decodes now: the others' calls wait for its next one (until it leaves)."""
        with self._cond:
            self._members.add(seq)
        try:
            yield
        finally:
            with self._cond:
                self._members.discard(seq)
                self._run_ready()  # the others' calls may have waited for its

    def call(self, seq: HFSequence, tokens: list[int], last_only: bool) -> torch.Tensor:
        """`seq`'s call, run with the other members' waiting ones: its logits [T, V] (or [1, V])."""
        with self._cond:
            slot = self._waiting[seq] = [tokens, last_only, None]
            self._run_ready()
            while slot[2] is None:
                self._cond.wait()
        if isinstance(slot[2], Exception):
            raise slot[2]
        return slot[2]

    def _run_ready(self) -> None:
        """With the lock held: when every member (or a non-member) has a call waiting, run them all."""
        ready = self._waiting and (
            set(self._waiting) >= self._members or any(s not in self._members for s in self._waiting)
        )
        if not ready:
            return
        calls = list(self._waiting.items())
        self._waiting.clear()
        try:
            for group in _groups(calls):
                for (_, slot), logits in zip(group, self._forward(group), strict=True):
                    slot[2] = logits
        except Exception as e:  # every waiting call gets the error, none waits forever
            for _, slot in calls:
                slot[2] = e if slot[2] is None else slot[2]
        finally:
            self._cond.notify_all()

    @torch.inference_mode()
    def _forward(self, group: list[tuple[HFSequence, list[Any]]]) -> list[torch.Tensor]:
        """One forward of the group's calls (module docstring); each call's logits. A call alone runs as
        the verifier runs it (its own cache, transformers' attention path), calls together packed."""
        model, dev = self.base.model, self.base.device
        spans, ids, pos, keep, s = [], [], [], [], 0
        for seq, (tokens, last_only, _) in group:
            T = len(tokens)
            spans.append((s, s + T))
            ids += tokens
            pos.append(torch.arange(seq._pos, seq._pos + T))
            keep += [s + T - 1] if last_only else range(s, s + T)
            s += T
        pack = Packed([seq._cache for seq, _ in group], spans)
        if len(group) == 1:  # as `HFVerifier.forward`
            cache, position_ids, keep_ = group[0][0]._cache, None, 1 if group[0][1][1] else 0
        else:
            cache, position_ids = _packed_cache(model, pack), torch.cat(pos)[None].to(dev)
            keep_ = torch.tensor(keep, device=dev)
        got: dict[int, torch.Tensor] = {}
        wanted = sorted({i for seq, _ in group for i in seq._layer_ids})
        hooks = [self.base._layers[i].register_forward_hook(_tap(got, i)) for i in wanted]
        token = PACK.set(pack if len(group) > 1 else None)
        try:
            out = model(
                input_ids=torch.tensor([ids], device=dev), position_ids=position_ids, cache=cache,
                use_cache=True, logits_to_keep=keep_,
            ).logits[0]  # fmt: skip  # [len(keep), V]
        finally:
            PACK.reset(token)
            for h in hooks:
                h.remove()
        self.sizes.append(len(group))
        logits, row = [], 0
        for (seq, (_, last_only, _)), (a, b) in zip(group, spans, strict=True):
            n = 1 if last_only else b - a
            logits.append(out[row : row + n])
            row += n
            seq._pos += b - a
            seq._since_crop += b - a
            seq._captured = {i: got[i][a:b] for i in seq._layer_ids}
            seq.batch_size = len(group)
        return logits


def _packed_cache(model: torch.nn.Module, pack: Packed) -> Any:
    """A transformers cache whose layers append each sequence's rows to its own cache (`packed_layer`)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    cache.layers = [packed_layer(pack, i) for i in range(len(cache.layers))]
    return cache


def _tap(store: dict[int, torch.Tensor], i: int) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        store[i] = (output[0] if isinstance(output, tuple) else output)[0]  # [sum T, H]

    return hook


def _groups(calls: list[tuple[HFSequence, list[Any]]]) -> Iterator[list[tuple[HFSequence, list[Any]]]]:
    """The calls in arrival order, grouped so no forward holds more than MAX_VERIFY_TOKENS rows (a longer
    call alone)."""
    group: list[tuple[HFSequence, list[Any]]] = []
    rows = 0
    for call in calls:
        T = len(call[1][0])
        if group and rows + T > MAX_VERIFY_TOKENS:
            yield group
            group, rows = [], 0
        group.append(call)
        rows += T
    if group:
        yield group


def _unsupported(v: HFVerifier) -> str | None:
    """Why `attend_packed` cannot run `v`'s model (None: it can)."""
    cfg = v.config
    if not v.batch_invariant:
        return f"its {v.dtype} verify is not batch-invariant here (measured at load)"
    if v._linear or v._kv_shared:
        return "its linear-attention / KV-shared layers are not packed yet"
    types = getattr(cfg, "layer_types", None) or ()
    windowed = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    if windowed or any(t != "full_attention" for t in types):
        return "its sliding-window layers are not packed yet"
    if any(hasattr(m, "sinks") for m in v.model.modules()):
        return "its attention sinks are not packed yet"
    return None


def packed_equals_solo(batch: HFBatch) -> bool:
    """Whether two sequences' calls packed into one forward give bit for bit the logits the verifier's own
    path gives the same calls (a prompt each, then a verify of several tokens and one of one), on the
    batch's model here. Leaves the verifier's own cache reset."""
    from specdec.measure import probe_ids

    ids = probe_ids(batch.base.vocab_size, 40)
    calls = [(ids[:20], ids[20:23]), (ids[20:31], ids[31:32])]
    solo = [batch.base.probe_logits(list(c))[1] for c in calls]
    seqs = [batch.sequence() for _ in calls]
    for seq, (prompt, _) in zip(seqs, calls, strict=True):
        seq.forward(prompt)  # not a member yet: runs alone
    got: dict[int, torch.Tensor] = {}
    with batch.member(seqs[0]), batch.member(seqs[1]):
        threads = [
            threading.Thread(target=lambda i=i: got.__setitem__(i, seqs[i].forward(calls[i][1])))
            for i in range(2)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    return len(got) == 2 and all(torch.equal(got[i], solo[i]) for i in range(2))
