"""How many intra-op threads a decode's torch ops use: set on purpose on the thread that decodes, and (asked
for) adapted when the machine gets busy.

torch's intra-op thread count is an OpenMP setting of the thread that calls the ops: a decode on a worker
thread (a server's engine, a chat app's background thread) runs with whatever that thread has, not what a
script set on its main thread. Measured on the 2-core EPYC (`specdec.evals.threads`, docs/performance.md):
two threads are the fastest on a quiet machine, but as soon as another process keeps one core busy they
lose 3x on the calling thread (OpenMP's threads spin-wait for a core that is not theirs), where one thread
keeps its speed.

So every step sets the count on the thread that runs it, and one `ThreadChoice` per loaded model can pick
the count from the steps' own times: it starts with torch's count (all cores unless the user set fewer) and
tries the other candidate for a few steps, alternating with the current one so both are timed under the
same load, early in the first run (a machine busy from the start), when two steps in a row run `SLOW`
times what the current count's recent steps predict for their rows (the machine got busy), and every
`gap` steps (it may have got quiet again; the gap doubles while the choice holds, up to `MAX_GAP`). The
other count takes over where its steps' median ratio to that prediction is below `KEEP` times the
current's.

Exact: a count may change mid-run only where the verifier's logits do not depend on it, measured on the
loaded model (`threads_invariant`: the same calls with each candidate, bit for bit); where they do, the
count stays fixed and `describe` says why. The adapting choice runs where `SPECDEC_THREADS=auto` asks for
it, and `SPECDEC_THREADS=N` sets N on every decoding thread; by default nothing is set and each thread
keeps its own count, as before (measured on the 2-core EPYC, adapting helped with one busy core and once
fell to a third of the fixed count's speed with two: docs/performance.md). The wait policy is
OpenMP's (`OMP_WAIT_POLICY`, read once when torch starts; not changed here).
"""

from __future__ import annotations

import os
import statistics
import threading
import weakref
from collections import deque
from typing import Any

import torch

from specdec.protocols import BatchedCalls

__all__ = ["KEEP", "MAX_GAP", "SLOW", "ThreadChoice", "choice_for", "reset_choice", "threads_invariant"]

#: two steps in a row this many times their predicted time mean the machine got busy: a trial now
SLOW = 1.5
#: the other count takes over where its median step over a trial is below KEEP times the current's (steps
#: as ratios to the current count's usual time for their shape)
KEEP = 0.9
#: steps per count in a trial (alternating); the steps before the first trial, between trials after a
#: switch, and at most (the gap doubles while the choice holds)
TRIAL, FIRST_TRIAL, FIRST_GAP, MAX_GAP = 4, 8, 32, 512
#: recent steps of the current count its expected times are fitted to, and how many before it predicts
WINDOW, MIN_STEPS = 24, 6


class ThreadChoice:
    """The intra-op thread count a loaded model's steps run with (module docstring). `apply()` before a
    step sets it on the calling thread; `record(threads, seconds, rows)` after it feeds the choice."""

    def __init__(self, candidates: tuple[int, ...], *, adapt: bool, why: str, inherit: bool = False) -> None:
        self.candidates = candidates  # the first: the count it starts with
        self.adapt = adapt and len(candidates) > 1
        self.inherit = inherit  # set nothing: each decoding thread keeps its own count
        self.why = why
        self.current = self.base = candidates[0]
        self.switches = 0
        self._lock = threading.Lock()  # engines on several threads may share a model
        self._recent: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # the current count's (rows, seconds)
        self._trial: list[tuple[int, float]] | None = None  # (count, time / usual) while a trial runs
        self._trial_steps = 0
        self._slow = 0  # consecutive steps over SLOW x their predicted time
        self._since, self._gap = 0, FIRST_TRIAL  # a machine busy from the start: a trial early

    def describe(self) -> str:
        """One line for the load log: the count and how it is chosen."""
        if self.inherit:
            return f"each decoding thread's own intra-op count ({self.why})"
        if not self.adapt:
            return f"{self.current} intra-op thread{'s' * (self.current > 1)} ({self.why})"
        other = " or ".join(str(c) for c in self.candidates[1:])
        return (
            f"{self.current} intra-op threads; {other} while steps time faster so (chosen as it decodes; "
            f"{self.why})"
        )

    def next_count(self) -> int:
        """The count the next step runs with (the trial's where one runs)."""
        with self._lock:
            if self._trial is not None:
                return self._trial_count()
            return self.current

    def apply(self, *, prompt: bool = False) -> int:
        """Set the next step's count on this thread (OpenMP's count is per thread); the count. A prompt's
        prefill runs with the first count always: only decode-shaped calls were measured to give the same
        logits with each (`threads_invariant`)."""
        if self.inherit:
            return torch.get_num_threads()
        n = self.base if prompt else self.next_count()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def record(self, threads: int, seconds: float, rows: int = 1) -> None:
        """A step of `rows` verified rows ran `threads` threads for `seconds`: the choice moves where the
        times say so. A step's time counts as its ratio to what the current count's recent steps predict
        for its rows (a line through them: a verify's cost grows with its rows where compute bounds it)."""
        if not self.adapt:
            return
        with self._lock:
            usual = self._usual(rows)
            if self._trial is not None:
                self._trial_steps += 1
                if usual is not None:
                    self._trial.append((threads, seconds / usual))
                if len(self._trial) >= TRIAL * len(self.candidates) or self._trial_steps > 8 * TRIAL:
                    self._end_trial()
                return
            if threads != self.current:  # a step of another engine's trial: not this count's time
                return
            self._since += 1
            busy = usual is not None and seconds > SLOW * usual
            self._slow = self._slow + 1 if busy else 0
            self._recent.append((rows, seconds))
            if self._slow >= 2 or self._since >= self._gap:
                self._trial, self._trial_steps, self._slow = [], 0, 0

    def _usual(self, rows: int) -> float | None:
        """The current count's expected time for a step of `rows` rows: least squares through its recent
        steps (None: too few yet)."""
        if len(self._recent) < MIN_STEPS:
            return None
        xs, ys = [float(r) for r, _ in self._recent], [s for _, s in self._recent]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        vx = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / vx) if vx else 0.0
        guess = my + slope * (rows - mx)
        return guess if guess > 0 else my

    def _trial_count(self) -> int:
        # during a trial, alternate: current, other(s), current, ... so a change of load hits both
        return self.candidates[len(self._trial or ()) % len(self.candidates)]

    def _end_trial(self) -> None:
        trial, self._trial, self._since = self._trial or [], None, 0
        ratios = {c: [r for n, r in trial if n == c] for c in self.candidates}
        if not all(ratios.values()):  # no step of some count timed against a reference: no verdict
            self._gap = min(2 * self._gap, MAX_GAP)
            return
        times = {c: statistics.median(r) for c, r in ratios.items()}
        best = min(times, key=times.__getitem__)
        if best != self.current and times[best] < KEEP * times[self.current]:
            self.current, self.switches, self._gap = best, self.switches + 1, FIRST_GAP
            self._recent.clear()  # the references were the old count's
            self.candidates = (best, *[c for c in self.candidates if c != best])
        else:
            self._gap = min(2 * self._gap, MAX_GAP)


_CHOICES: weakref.WeakKeyDictionary[Any, ThreadChoice] = weakref.WeakKeyDictionary()
_MADE = threading.Lock()


def choice_for(verifier: Any, *, probe: bool = True) -> ThreadChoice:
    """The loaded model's `ThreadChoice`, made on first use (with `SPECDEC_THREADS=auto`, `threads_invariant`
    measured there, which resets the verifier's cache). `probe=False` (its cache holds a run to go on
    with): where none was made yet, one that sets nothing, for this run only (so too for a verifier that
    cannot be a weak key)."""
    with _MADE:
        try:
            choice = _CHOICES.get(verifier)
        except TypeError:  # a verifier that cannot be weakly keyed (unhashable)
            choice, probe = None, False
        if choice is None and not probe:
            return ThreadChoice((torch.get_num_threads(),), adapt=False, why="not chosen", inherit=True)
        if choice is None:
            choice = _CHOICES[verifier] = _make(verifier)
        return choice


def reset_choice(verifier: Any, *, fixed: int | None = None) -> None:
    """Forget the model's choice (the next run makes it afresh), or fix its count at `fixed`."""
    with _MADE:
        _CHOICES.pop(verifier, None)
        if fixed is not None:
            _CHOICES[verifier] = ThreadChoice((fixed,), adapt=False, why="fixed by the caller")


def _make(verifier: Any) -> ThreadChoice:
    asked = os.environ.get("SPECDEC_THREADS", "")
    if asked and asked != "auto":
        if not asked.isdigit() or int(asked) < 1:
            raise ValueError(f"SPECDEC_THREADS must be a positive integer or 'auto', got {asked!r}")
        return ThreadChoice((int(asked),), adapt=False, why="SPECDEC_THREADS")
    full = torch.get_num_threads()
    if asked != "auto":  # the default, as before: docs/performance.md has what adapting measured here
        why = "SPECDEC_THREADS=N sets N on every one, =auto adapts it"
        return ThreadChoice((full,), adapt=False, why=why, inherit=True)
    if full == 1:
        return ThreadChoice((1,), adapt=False, why="torch's count on this thread")
    if isinstance(verifier, BatchedCalls):  # a batch's sequences: forwards run on whichever thread comes last
        return ThreadChoice((full,), adapt=False, why="a batch's forwards run on several threads")
    candidates = (full, full // 2)  # half the cores: on two, one thread (what the measurements compared)
    why = threads_invariant(verifier, candidates)
    if why is not None:
        return ThreadChoice((full,), adapt=False, why=why)
    return ThreadChoice(candidates, adapt=True, why="the verifier's logits measured the same with each")


def threads_invariant(verifier: Any, candidates: tuple[int, ...]) -> str | None:
    """None where the verifier's decode-shaped calls (a verify of 8 rows, a step of one, after a prompt
    whose keys cross an alignment block) give bit for bit the same logits with every candidate count on the
    loaded model, else why not. A prompt always runs with the first count (`ThreadChoice.apply`), so
    the cache those calls read is the same whatever the count. Leaves the verifier's cache reset."""
    if getattr(verifier, "runtime", None) == "mlx":
        return None  # MLX's logits: torch's count only moves a torch drafter's work, never the tokens
    if not (hasattr(verifier, "forward") and hasattr(verifier, "rollback")):
        return "its calls cannot be probed here, so the count stays"
    from specdec.kernels import KEY_ALIGN
    from specdec.measure import probe_ids

    ids = probe_ids(verifier.vocab_size, KEY_ALIGN + 17)
    prompt, calls = ids[: KEY_ALIGN + 8], [ids[KEY_ALIGN + 8 : -1], ids[-1:]]
    before = torch.get_num_threads()
    got: list[list[torch.Tensor]] = []
    try:
        verifier.reset()
        torch.set_num_threads(candidates[0])
        verifier.forward(prompt, last_only=True)
        for n in candidates:
            torch.set_num_threads(n)
            got.append([verifier.forward(c).clone() for c in calls])
            verifier.rollback(sum(map(len, calls)))
    except Exception as e:  # a model whose cache cannot take the probe: its count stays (one line)
        return f"its count could not be probed ({type(e).__name__}), so it stays"
    finally:
        torch.set_num_threads(before)
        verifier.reset()
    for n, out in zip(candidates[1:], got[1:], strict=True):
        if not all(torch.equal(a, b) for a, b in zip(got[0], out, strict=True)):
            return f"its logits differ with {n} threads here (measured), so the count stays"
    return None
