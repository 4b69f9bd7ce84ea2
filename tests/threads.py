"""Calls started together on threads of their own, as concurrent clients or requests are."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def at_once(fn: Callable[[int], Any], n: int) -> list[Any]:
    """fn(0) .. fn(n - 1), each on a thread of its own, all started before any is waited for: what each
    returned, in order."""
    out: list[Any] = [None] * n
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fn(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
