"""Where several sequences' verifier calls meet to run in one forward: the runtime-free half of a batch.

A batch (`verifiers.hf_batch.HFBatch`, `verifiers.mlx_batch.MLXBatch`) is a `Rendezvous` over one loaded
verifier. While sequences are members (`member`: what `specdec.batch` holds around a request's run), a
call of one (`call`) waits until every member has one waiting; then the calls run, grouped so that no
forward holds more rows than the runtime's `fits` allows, each group in one `_forward` (the runtime's
half). A non-member's call (a sequence before its request starts, a measurement) runs at once.

`solo_mismatch` is the measurement every batch makes when it is built: calls of two sequences run
together give bit for bit the logits the verifier's own path gives the same calls alone, or why not.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Call", "Rendezvous", "solo_mismatch", "together"]

Call = tuple[Any, list[Any]]  # (sequence, [tokens, last_only, result or None])


class Rendezvous:
    """Members' calls run together (module docstring); a runtime supplies `_forward` and `fits`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._members: set[Any] = set()
        self._waiting: dict[Any, list[Any]] = {}  # in arrival order: [tokens, last_only, result]
        self.sizes: list[int] = []  # the calls of each forward run, in order (what benchmarks read)

    @contextmanager
    def member(self, seq: Any) -> Iterator[None]:
        """`seq` decodes now: the others' calls wait for its next one (until it leaves)."""
        with self._cond:
            self._members.add(seq)
        try:
            yield
        finally:
            with self._cond:
                self._members.discard(seq)
                self._run_ready()  # the others' calls may have waited for its

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

    def fits(self, lengths: list[int]) -> bool:
        """Whether calls of these token counts may share one forward."""
        raise NotImplementedError

    def _forward(self, group: list[Call]) -> list[Any]:
        """One forward of the group's calls: each call's result, in order."""
        raise NotImplementedError

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
            for group in self._groups(calls):
                for (_, slot), result in zip(group, self._forward(group), strict=True):
                    slot[2] = result
                self.sizes.append(len(group))
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


def together(batch: Any, seqs: list[Any], fn: Any) -> list[Any]:
    """`fn(i)` for every `seqs[i]` at once, each sequence a member of `batch`, each call on a thread of its
    own (so their calls meet): what each returned, or the exception it raised."""
    got: list[Any] = [None] * len(seqs)

    def run(i: int) -> None:
        try:
            got[i] = fn(i)
        except Exception as e:  # reported in its slot
            got[i] = e

    with contextlib.ExitStack() as stack:
        for seq in seqs:
            stack.enter_context(batch.member(seq))
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
            return f"its forward of several sequences fails ({type(got[i]).__name__}: {got[i]})"
        if not torch.equal(got[i], solo[i]):
            dtype = getattr(batch.base, "dtype", "?")
            return (
                f"its rows together do not give the logits of the same calls alone here in {dtype} (measured)"
            )
    return None
