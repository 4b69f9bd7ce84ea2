"""Who may run on a loaded model now, and whose tokens its cache holds.

A verifier or a drafter object owns one cache. Two runs that share one (two `StreamingEngine`s or
`ChatSession`s over one loaded model, two threads calling `api.run`) must not interleave their calls, and
a run that reuses what a cache holds must know that nobody else has changed it since.
`hold(owner, *models)` gives both: it waits while another owner's run holds any of `models` on another
thread, and says whether `owner` was the last to hold every one of them (only then is a cache as `owner`
left it).

A run holds its models from its first step to its end (close, cancel, error); the same owner may hold
them again inside (the streaming engine around `engine.decode`). A second owner asking on the thread
that holds them would wait for itself (two streams iterated in turn on one thread): that is refused with
a RuntimeError instead.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Run", "hold"]


class _Lease:
    """One model's lock, the owner holding it (with how deeply, and on which thread) and its last owner."""

    __slots__ = ("depth", "holder", "last", "lock", "thread")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holder: object | None = None
        self.depth = 0
        self.thread: int | None = None
        self.last: weakref.ref | None = None  # the last owner, not kept alive by the model


class Run:
    """An owner for a run that has no longer-lived owner of its own (one `engine.decode` call)."""


_LEASES: weakref.WeakKeyDictionary[object, _Lease] = weakref.WeakKeyDictionary()
_REGISTRY = threading.Lock()


def _lease(model: object) -> _Lease:
    with _REGISTRY:
        lease = _LEASES.get(model)
        if lease is None:
            lease = _LEASES[model] = _Lease()
        return lease


def _acquire(lease: _Lease, owner: object, name: str) -> bool:
    """Take `lease` for `owner`; whether `owner` held it last."""
    if lease.holder is owner:  # the same run, one level further in
        lease.depth += 1
        return True
    if lease.holder is not None and lease.thread == threading.get_ident():
        raise RuntimeError(
            f"{name} is in use by another run on this thread (two streams iterated in turn?): finish or "
            "close that one first, or give each conversation a model of its own"
        )
    lease.lock.acquire()
    lease.holder, lease.depth, lease.thread = owner, 1, threading.get_ident()
    return lease.last is not None and lease.last() is owner


def _release(lease: _Lease, owner: object) -> None:
    lease.depth -= 1
    if lease.depth == 0:
        lease.last = weakref.ref(owner)
        lease.holder = lease.thread = None
        lease.lock.release()


@contextmanager
def hold(owner: object, *models: object | None) -> Iterator[bool]:
    """Hold `models` (None entries are skipped) for `owner` while the block runs; yields whether `owner` was
    the last to hold every one of them. Models are taken in a fixed order, so two runs asking for the same
    two never wait for each other."""
    leases = [
        (_lease(m), _name(m)) for m in sorted({id(m): m for m in models if m is not None}.values(), key=id)
    ]
    taken: list[_Lease] = []
    mine = True
    try:
        for lease, name in leases:
            mine &= _acquire(lease, owner, name)
            taken.append(lease)
        yield mine
    finally:
        for lease in reversed(taken):
            _release(lease, owner)


def _name(model: object) -> str:
    return (
        f"{type(model).__name__} {getattr(model, 'model_name', None) or getattr(model, 'name', '')}".strip()
    )
