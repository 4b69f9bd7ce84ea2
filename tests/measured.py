"""What a test measures itself before it takes a refusal as the contract.

A feature that is exact only where the machine's kernels allow it (a batch of sequences, speculation in
bf16) is refused where they do not. A test passes on such a refusal only where its own measurement, made
here on the loaded model independently of the flag the verifier keeps, says the feature cannot be exact:
a refusal on a machine where it could be exact fails the test, so a feature that silently turned itself
off (a measurement forced False, a refusal for the wrong reason) cannot pass as refused.
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate, pairwise
from typing import Any

import torch

from specdec.kernels import KEY_ALIGN, MAX_VERIFY_TOKENS

_ROWS: dict[int, bool] = {}
#: the call sizes a verify of MAX_VERIFY_TOKENS rows is compared with (its rows in calls of these sizes)
CHUNKS = (1, 2, 3, 5, 8, 13, 32)


def rows_independent(v: Any) -> bool:
    """Whether a verify of MAX_VERIFY_TOKENS tokens on `v`'s model gives every row bit for bit what calls
    of other sizes (`CHUNKS`, and one token at a time) give at the same positions, measured here through
    `v.probe_logits` (cached per verifier)."""
    if id(v) not in _ROWS:
        assert sum(CHUNKS) == MAX_VERIFY_TOKENS
        n = KEY_ALIGN - 3  # the block's keys cross an alignment boundary
        ids = [(53 * i + 17) % (v.vocab_size - 2) + 1 for i in range(n + MAX_VERIFY_TOKENS)]
        prompt, block = ids[:n], ids[n:]
        whole = v.probe_logits([prompt, block])[1]
        chunks = [block[i:j] for i, j in pairwise(accumulate(CHUNKS, initial=0))]
        sized = torch.cat(v.probe_logits([prompt, *chunks])[1:])
        steps = torch.cat(v.probe_logits([prompt, *([t] for t in block)])[1:])
        _ROWS[id(v)] = torch.equal(whole, sized) and torch.equal(whole, steps)
    return _ROWS[id(v)]


def assert_refusal_measured(v: Any, refusal: BaseException) -> None:
    """`refusal` (a batch, or bf16 speculation, refused on `v`) is what this machine's measurement says:
    `v`'s rows do depend on the call they are in (`rows_independent` False), and the verifier says so."""
    assert not rows_independent(v), (
        f"refused ({refusal}), but {v.model_name}'s rows measured here do not depend on the call: the "
        "feature could be exact on this machine and must run"
    )
    assert not v.batch_invariant, "the verifier claims invariance its refusal denies"


def batch_or_refused(v: Any) -> Any:
    """The batch over `v`; None where this machine's own measurement says calls cannot share a forward
    exactly here (`assert_refusal_measured`: the refusal is then the contract, checked, not assumed)."""
    from specdec.batch import batch_of

    try:
        return batch_of(v)
    except ValueError as e:
        if "cannot verify several sequences in one forward" not in str(e):
            raise
        assert_refusal_measured(v, e)
        return None


def exact_or_measured_not(v: Any) -> bool:
    """Whether `v`'s verify is batch-invariant (its rows alone equal its rows together), asserting that
    its own flag agrees with what the test measures: True where speculation must be bit for bit exact."""
    measured = rows_independent(v)
    assert v.batch_invariant == measured, (
        f"{v.model_name}: the verifier says batch_invariant={v.batch_invariant}, the test measured {measured}"
    )
    return measured


def shared(batch: Any, since: Counter[int]) -> int:
    """The most calls one forward of `batch` ran together since its counts were `since` (`batch.forwards`
    copied before the requests ran: their own forwards, not the two-sequence measurement every batch
    makes when it is built); 0: none ran."""
    return max((k for k, n in (batch.forwards - since).items() if n > 0), default=0)
