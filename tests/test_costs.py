"""Verify costs (`specdec.costs`) and the draft lengths they choose."""

from __future__ import annotations

import pytest

from specdec.costs import VerifyCosts
from specdec.verifiers.stub import StubVerifier


def test_rate_by_hand():
    c = VerifyCosts((1.0, 1.0, 1.5, 1.5), "t")
    # k=1 commits 1 + 0.9 per 1.0; k=2 commits 1 + 0.9 + 0.45 per 1.5: one draft is best
    assert c.rate([0.9, 0.5]) == (1, pytest.approx(1.9))
    assert c.best_length([0.9, 0.9]) == 1  # a second costs half a step: 2.71 / 1.5 < 1.9
    assert c.best_length([]) == 0 and c.best_length([0.0]) == 0  # nothing beats a one-token step
    assert c.best_length([0.9, 0.9, 0.9, 0.9]) == 4  # a fourth token is free after the third


def test_flat_and_steep_costs():
    flat = VerifyCosts((1.0, 1.0), "gpu-like")  # beyond the table the last slope (0) goes on
    assert flat.cost(16) == 1.0 and flat.best_length([0.5] * 15) == 15  # any chance pays
    steep = VerifyCosts((1.0, 2.0), "t")  # each token costs a whole step
    assert steep.cost(4) == 4.0 and steep.best_length([0.99] * 5) == 0


def test_from_seconds_and_from_table():
    c = VerifyCosts.from_seconds({1: 0.1, 2: 0.1, 4: 0.2}, source="x")
    assert c.relative == pytest.approx((1.0, 1.0, 1.5, 2.0))
    table = {"relative": {"128": {"1": 1.0, "2": 1.2, "4": 1.6}, "512": {"1": 1.0, "2": 1.0, "4": 1.2}}}
    assert VerifyCosts.from_table(table, source="f").relative == pytest.approx((1.0, 1.1, 1.25, 1.4))
    with pytest.raises(ValueError, match="1 and 2 tokens"):
        VerifyCosts.from_seconds({1: 0.1, 4: 0.2}, source="x")
    with pytest.raises(ValueError, match="no 'relative' costs"):
        VerifyCosts.from_table({"seconds": {}}, source="f")
    with pytest.raises(ValueError, match="malformed cost table"):
        VerifyCosts.from_table({"relative": {"1": {"x": 1}}}, source="f")
    with pytest.raises(ValueError, match="positive costs"):
        VerifyCosts((1.0,), "t")


def test_measure_times_the_verifier_and_leaves_it_reset():
    v = StubVerifier()
    c = VerifyCosts.measure(v, reps=2)
    assert c.source == "measured" and len(c.relative) == 16 and c.relative[0] == 1.0
    assert all(x > 0 for x in c.relative) and v.position == 0
    assert c.to_json()["relative"][0] == 1.0 and c.summary().startswith("verify costs (measured): 2 tokens")
