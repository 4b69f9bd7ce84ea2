"""The intra-op thread count a decode runs with (`specdec.threads`): set on the decoding thread at every
step, chosen by the steps' own times, changed mid-run only where the verifier's logits are measured not to
depend on it."""

from __future__ import annotations

import os
import threading
from itertools import pairwise

import pytest
import torch

from specdec import threads as th
from specdec.engine import DecodeConfig, generate
from specdec.threads import ThreadChoice, choice_for, reset_choice, threads_invariant
from specdec.verifiers.stub import StubVerifier

QUIET = {2: 0.10, 1: 0.12}  # two threads faster (the quiet 2-core machine)
BUSY = {2: 0.30, 1: 0.12}  # another process on one core: two threads lose 3x, one keeps its speed


def feed(choice: ThreadChoice, times: dict[int, float], steps: int) -> list[int]:
    """`steps` steps whose time depends on their count only; the counts they ran."""
    ran = []
    for _ in range(steps):
        n = choice.next_count()
        choice.record(n, times[n])
        ran.append(n)
    return ran


def test_a_machine_busy_from_the_start_gets_one_thread_within_a_few_steps():
    c = ThreadChoice((2, 1), adapt=True, why="test")
    feed(c, BUSY, th.FIRST_TRIAL + 2 * th.TRIAL)
    assert (c.current, c.switches) == (1, 1)


def test_the_count_follows_the_load():
    c = ThreadChoice((2, 1), adapt=True, why="test")
    ran = feed(c, QUIET, 300)
    assert (c.current, c.switches) == (2, 0)
    assert ran.count(1) <= 0.1 * len(ran)  # trials of one thread are a small part of a quiet run
    # busy: two slow steps start a trial at once, and the trial gives one thread
    feed(c, BUSY, 2 + 2 * th.TRIAL)
    assert (c.current, c.switches) == (1, 1)
    feed(c, BUSY, 300)
    assert c.current == 1
    # quiet again: a periodic trial within the longest gap gives two threads back
    feed(c, QUIET, th.MAX_GAP + 2 * th.TRIAL + 1)
    assert (c.current, c.switches) == (2, 2)


def test_one_slow_step_or_a_small_gain_moves_nothing():
    c = ThreadChoice((2, 1), adapt=True, why="test")
    feed(c, QUIET, th.FIRST_TRIAL + 2 * th.TRIAL + 10)  # past the early trial
    c.record(2, 1.0)  # one outlier (a page fault, a GC pause)
    assert c.next_count() == 2 and c._trial is None
    close = {2: 0.10, 1: 0.095}  # one thread 5% faster: under KEEP, not worth a switch
    feed(c, close, 400)
    assert c.switches == 0


def test_steps_of_many_rows_are_not_taken_for_load():
    """Where compute bounds a verify (bf16 emulated here), 16 rows cost 3x one row: steps of mixed shapes,
    in random order, on a quiet machine, start no trial early and move nothing."""
    import random

    c = ThreadChoice((2, 1), adapt=True, why="test")
    cost = {(2, 1): 0.10, (2, 16): 0.30, (1, 1): 0.12, (1, 16): 0.50}
    rng = random.Random(0)
    trials = 0
    for _ in range(400):
        rows, n = rng.choice([1, 16]), c.next_count()
        in_trial = c._trial is not None
        c.record(n, cost[n, rows], rows)
        trials += not in_trial and c._trial is not None
    assert c.switches == 0 and c.current == 2
    assert trials <= 5  # the periodic ones only (gaps 32, 64, 128, 256): no slow-step alarms


def test_a_fixed_count_never_changes():
    c = ThreadChoice((2,), adapt=False, why="test")
    assert set(feed(c, BUSY, 100)) == {2}
    assert c.describe() == "2 intra-op threads (test)"


class Scripted(ThreadChoice):
    """A choice that alternates 2, 1, 2, ... every step: the worst a real choice could do to a run."""

    def __init__(self) -> None:
        super().__init__((2, 1), adapt=True, why="scripted")
        self.i = 0

    def next_count(self) -> int:
        self.i += 1
        return 2 if self.i % 2 else 1


def _seen_in_forward(v: object) -> list[int]:
    """torch's count on the thread where each of the verifier's forwards runs."""
    seen: list[int] = []
    real = v.forward

    def forward(*a: object, **k: object) -> object:
        seen.append(torch.get_num_threads())
        return real(*a, **k)

    v.forward = forward  # type: ignore[method-assign]
    return seen


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_steps_run_the_chosen_count_on_any_thread_and_a_switch_keeps_the_tokens():
    v = StubVerifier()
    prompt = list(range(3, 30)) * 2
    cfg = DecodeConfig(max_new_tokens=24, block_size=4)
    from specdec.drafting.lookup.prompt import PromptLookupDrafter

    reset_choice(v, fixed=2)
    want = generate(v, prompt, drafter=PromptLookupDrafter(), cfg=cfg)
    th._CHOICES[v] = Scripted()
    seen = _seen_in_forward(v)
    got: dict[str, object] = {}

    def on_worker() -> None:  # a thread whose own count says 1: the model's choice wins
        torch.set_num_threads(1)
        got["r"] = generate(v, prompt, drafter=PromptLookupDrafter(), cfg=cfg)

    t = threading.Thread(target=on_worker)
    t.start()
    t.join()
    r = got["r"]
    assert r.output_tokens == want.output_tokens
    decode = [s.threads for s in r.steps[1:]]
    assert len(decode) >= 4 and all(a != b for a, b in pairwise(decode))  # switched every step
    assert seen[1:] == decode  # what each step's verify forward ran with
    assert seen[0] == 2  # the prefill: the first count, always (only decode shapes were measured)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_a_count_that_moves_the_logits_is_not_changed(monkeypatch):
    v = StubVerifier()
    real = v.forward
    monkeypatch.setattr(  # logits that depend on the count, as a kernel splitting a reduction might give
        v, "forward", lambda *a, **k: real(*a, **k) + torch.get_num_threads() * 1e-6
    )
    torch.set_num_threads(2)  # the tests' own 1 (conftest) back to what a user's thread has
    why = threads_invariant(v, (2, 1))
    assert why == "its logits differ with 1 threads here (measured), so the count stays"
    monkeypatch.setenv("SPECDEC_THREADS", "auto")
    reset_choice(v)
    c = choice_for(v)
    assert not c.adapt and c.why == why
    assert threads_invariant(StubVerifier(), (2, 1)) is None  # the stub's own logits do not move


def test_specdec_threads_fixes_the_count_or_asks_for_adapting(monkeypatch):
    torch.set_num_threads(2)  # a user's thread (the tests' own is 1, conftest)
    monkeypatch.delenv("SPECDEC_THREADS", raising=False)
    c = choice_for(StubVerifier())  # the default: nothing set, each thread keeps its own
    assert c.inherit and not c.adapt and "=auto adapts" in c.describe()
    torch.set_num_threads(1)
    assert c.apply() == 1 and torch.get_num_threads() == 1
    torch.set_num_threads(2)
    monkeypatch.setenv("SPECDEC_THREADS", "1")
    c = choice_for(StubVerifier())
    assert (c.candidates, c.adapt) == ((1,), False)
    monkeypatch.setenv("SPECDEC_THREADS", "auto")
    c = choice_for(StubVerifier())
    assert (c.candidates, c.adapt) == ((2, 1), True)
    monkeypatch.setenv("SPECDEC_THREADS", "two")
    with pytest.raises(ValueError, match="SPECDEC_THREADS must be a positive integer or 'auto', got 'two'"):
        choice_for(StubVerifier())


@pytest.mark.hf
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_real_architecture_adapts_only_where_measured_exact(tmp_path, dtype, monkeypatch):
    """A tiny Llama on the HF verifier: where the measurement says its decode-shaped logits do not move
    with the count, a run switching every step equals a run at a fixed count token for token; where it
    says they move, the choice is fixed."""
    pytest.importorskip("transformers")
    import tinymodels

    from specdec.drafting.lookup.prompt import PromptLookupDrafter
    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(tinymodels.tiny_llama(tmp_path / "m"), dtype=dtype)
    torch.set_num_threads(2)  # a user's thread (the tests' own is 1, conftest)
    why = threads_invariant(v, (2, 1))
    monkeypatch.setenv("SPECDEC_THREADS", "auto")
    reset_choice(v)
    assert choice_for(v).adapt == (why is None)
    if why is not None:
        return  # measured: the count stays (the assert above), nothing switches to compare
    prompt = [3, 7, 11, 5, 9] * 6
    cfg = DecodeConfig(max_new_tokens=32, block_size=4)
    reset_choice(v, fixed=2)
    want = generate(v, prompt, drafter=PromptLookupDrafter(), cfg=cfg).output_tokens
    th._CHOICES[v] = Scripted()
    assert generate(v, prompt, drafter=PromptLookupDrafter(), cfg=cfg).output_tokens == want
