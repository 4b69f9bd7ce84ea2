"""Where several sequences' verifier calls meet to run in one forward: the runtime-free half of a batch.

A batch (`verifiers.hf_batch.HFBatch`, `verifiers.mlx_batch.MLXBatch`, `verifiers.stub_batch.StubBatch`)
is a `Rendezvous` over one loaded verifier. While sequences are members (`member`: what `engine.decode`
holds around a run on a sequence), a call of one (`call`) waits until every member that is working has
one waiting; then the calls run, grouped so that no forward holds more rows than the runtime's `fits`
allows, each group in one `_forward` (the runtime's half). A member is not waited for while its run has
handed control to its consumer (`parked`: at every yield of `engine.decode`), so a stream nobody iterates
never holds the others up, and no timer decides what shares a forward: who is working does. A
non-member's call (a sequence before its request starts, a measurement) runs at once.

`solo_mismatch` is the measurement every batch makes when it is built: calls of two sequences run
together give bit for bit the logits the verifier's own path gives the same calls alone, or why not.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from specdec.kernels import MAX_VERIFY_TOKENS

__all__ = ["Call", "Member", "Rendezvous", "solo_mismatch", "together"]

Call = tuple[Any, list[Any]]  # (sequence, [tokens, last_only, result or None])


class Rendezvous:
    """Members' calls run together (module docstring) on the loaded verifier `base`; a runtime supplies
    `sequence` and `_forward` (and `fits` where its rows are not packed)."""

    def __init__(self, base: Any) -> None:
        self.base = base
        self._cond = threading.Condition()
        self._members: dict[Any, int] = {}  # member -> how many times it joined (runs inside runs)
        self._parked: set[Any] = set()  # members not waited for: their consumers have control
        self._waiting: dict[Any, list[Any]] = {}  # in arrival order: [tokens, last_only, result]
        #: how many forwards ran how many calls together (what benchmarks and tests read): a count per
        #: size, so a server that runs for weeks keeps a few integers, not one per forward
        self.forwards: Counter[int] = Counter()

    @property
    def lock(self) -> threading.Condition:
        """Held while a forward runs: what else touches the shared model takes it too."""
        return self._cond

    @contextmanager
    def member(self, seq: Any) -> Iterator[None]:
        """`seq` decodes now: the others' calls wait for its next one while it works (until it leaves, or
        parks). Reentrant: it leaves when the outermost block ends."""
        self.join(seq)
        try:
            yield
        finally:
            self.leave(seq)

    def join(self, seq: Any) -> None:
        """`seq` is a member (once more, where it is one): `member`'s start, for a caller that leaves on
        another thread (`together`)."""
        with self._cond:
            self._members[seq] = self._members.get(seq, 0) + 1

    def leave(self, seq: Any) -> None:
        """Undo one `join`; at the last, `seq` is no longer waited for."""
        with self._cond:
            self._members[seq] -= 1
            if not self._members[seq]:
                del self._members[seq]
                self._parked.discard(seq)
                self._run_ready()  # the others' calls may have waited for its

    @contextmanager
    def parked(self, seq: Any) -> Iterator[None]:
        """While `seq`'s run has handed control to its consumer (who may take a while, or never come
        back): the others' calls do not wait for its next one."""
        with self._cond:
            working = seq in self._members and seq not in self._parked
            if working:
                self._parked.add(seq)
                self._run_ready()  # the others' calls may have waited for its
        try:
            yield
        finally:
            if working:
                with self._cond:
                    self._parked.discard(seq)

    def call(self, seq: Any, tokens: list[int], last_only: bool) -> Any:
        """`seq`'s call, run with the other members' waiting ones: what `_forward` gave it."""
        with self._cond:
            slot = self._waiting[seq] = [tokens, last_only, None]
            self._run_ready()
            while slot[2] is None:
                self._cond.wait()
        if isinstance(slot[2], Exception):
            raise slot[2]
        return slot[2]

    def refuse(self, why: str | None) -> None:
        """Raise the one-line ValueError of a batch that cannot be exact, where there is a `why`."""
        if why:
            raise ValueError(f"{self.base.model_name} cannot verify several sequences in one forward: {why}")

    def fits(self, lengths: list[int]) -> bool:
        """Whether calls of these token counts may share one forward: packed rows, at most the rows the
        verifier's linears were measured row-invariant up to (`batch_invariant`)."""
        return sum(lengths) <= MAX_VERIFY_TOKENS

    def _forward(self, group: list[Call]) -> list[Any]:
        """One forward of the group's calls: each call's result, in order."""
        raise NotImplementedError

    def _run_ready(self) -> None:
        """With the lock held: when every working member (or a non-member) has a call waiting, run the
        waiting calls."""
        ready = self._waiting and (
            self._waiting.keys() >= self._members.keys() - self._parked
            or any(s not in self._members for s in self._waiting)
        )
        if not ready:
            return
        calls = list(self._waiting.items())
        self._waiting.clear()
        try:
            for group in self._groups(calls):
                for (seq, slot), result in zip(group, self._forward(group), strict=True):
                    slot[2], seq.batch_size = result, len(group)  # `BatchedCalls.batch_size`
                self.forwards[len(group)] += 1
        except Exception as e:  # every waiting call gets the error, none waits forever
            for _, slot in calls:
                slot[2] = e if slot[2] is None else slot[2]
        finally:
            self._cond.notify_all()

    def _groups(self, calls: list[Call]) -> Iterator[list[Call]]:
        """The calls in arrival order, cut into groups that `fits` (a call that fits nothing runs alone)."""
        group: list[Call] = []
        for call in calls:
            lengths = [len(c[1][0]) for c in group] + [len(call[1][0])]
            if group and not self.fits(lengths):
                yield group
                group = []
            group.append(call)
        if group:
            yield group


class Member:
    """What a sequence of a batch is beyond its runtime's verifier (put first among its bases): the loaded
    verifier's state (`join`), its membership (`BatchedCalls.member`), chains only."""

    batch: Rendezvous
    batch_size: int  # `BatchedCalls`: the calls the forward of its last call ran
    model_name: str

    def join(self, batch: Rendezvous) -> None:
        """Take the loaded verifier's state (not its loading), as a sequence of `batch`."""
        self.__dict__.update(batch.base.__dict__)
        self.batch, self.batch_size = batch, 1

    def member(self) -> AbstractContextManager[None]:
        return self.batch.member(self)

    def parked(self) -> AbstractContextManager[None]:
        return self.batch.parked(self)

    def check_tree(self) -> None:
        raise ValueError(f"{self.model_name}: a sequence verified in a batch verifies chains; use a chain")


def together(batch: Any, seqs: list[Any], fn: Any) -> list[Any]:
    """`fn(i)` for every `seqs[i]` at once, each sequence a member of `batch`, each call on a thread of its
    own (so their calls meet): what each returned, or the exception it raised."""
    got: list[Any] = [None] * len(seqs)

    def run(i: int) -> None:
        try:
            got[i] = fn(i)
        except Exception as e:  # reported in its slot
            got[i] = e
        finally:
            batch.leave(seqs[i])  # as soon as its `fn` is done: no one waits for a next call of its

    for seq in seqs:  # all join before any calls, so their calls meet
        batch.join(seq)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(seqs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return got


def solo_mismatch(batch: Any) -> str | None:
    """Why calls of two sequences run together do not give bit for bit the logits the verifier's own path
    gives the same calls (a prompt each, then a verify of several tokens and one of one) on the batch's
    model here (`batch.base`, `batch.sequence()`); None where they do. May reset the verifier's cache."""
    import torch

    from specdec.measure import probe_ids

    ids = probe_ids(batch.base.vocab_size, 40)
    calls = [(ids[:20], ids[20:23]), (ids[20:31], ids[31:32])]
    solo = [batch.base.probe_logits(list(c))[1] for c in calls]
    seqs = [batch.sequence() for _ in calls]
    for seq, (prompt, _) in zip(seqs, calls, strict=True):
        seq.prefill(prompt)  # not a member yet: runs alone

    def verify(i: int) -> Any:
        kept: list[torch.Tensor] = []

        def keep(logits: torch.Tensor) -> list[int]:  # the torch view of the call's logits [T, V]
            kept.append(logits.clone())
            return [0] * logits.shape[0]

        seqs[i].verify(calls[i][1], sample=keep)
        return kept[0]

    got = together(batch, seqs, verify)
    for i in range(2):
        if isinstance(got[i], Exception):
            why = " ".join(str(got[i]).split())[:200]  # one line, whatever the runtime's message
            return f"its forward of several sequences fails ({type(got[i]).__name__}: {why})"
        if not torch.equal(got[i], solo[i]):
            dtype = getattr(batch.base, "dtype", "?")
            return (
                f"its rows together do not give the logits of the same calls alone here in {dtype} (measured)"
            )
    return None
