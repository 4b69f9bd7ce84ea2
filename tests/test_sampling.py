"""Sampling at T > 0: the speculative output distribution equals plain sampling, statistically.

The exact joint distribution of the first three tokens is computed by enumeration on a stub verifier
with a 6-token vocabulary, then compared with the empirical distribution over many seeds by a
chi-square test at a fixed false-alarm rate. A deliberately broken rule must fail the same test.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from drafters import ScriptedDrafter

from specdec.engine import DecodeConfig, generate
from specdec.memory import probe_for_device
from specdec.sampling import Sampler, SamplingParams, sample_from, warp
from specdec.verifiers.stub import StubConfig, StubVerifier

V = 6
PROMPT = [1, 4, 2]
N_SAMPLES = 2000
#: a negative control draws half of that: a broken rule caught with fewer samples is caught with more
#: too (the test's power grows with the samples), and the control costs half the time
N_BROKEN = 1000
#: a drafter's walk (its drafts and the q rows it reports, on a real tiny model: tens of ms a sample) is
#: checked with 600 samples: the engine's rules are proven at N_SAMPLES on the stub, and what a walk can
#: get wrong (a q row that is not the one its draft was drawn from) the negative controls catch at 600
#: with 1.9-25x their limit (DFlash2 316 against 50, DSpark 493 / 56, EAGLE-3 1198 / 48, MTP 140 / 72;
#: 2026-12-07, AVX2-only kind). A distribution spread almost evenly over the 216 triples (p ~ 0.005 each)
#: needs more (`N_WALK_EVEN`: the Gemma-4 assistant's, where 600 samples left 3 bins of 5 expected and its
#: control passed; at 1000, 79 bins and 604 against 122)
N_WALK = 600
N_WALK_EVEN = 1000
ALPHA = 1e-3  # false-alarm rate per test


@pytest.fixture(autouse=True)
def _one_thread():
    """Even the slow-marked statistical tests run tiny models: one intra-op thread (see conftest)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def verifier() -> StubVerifier:
    cfg = StubConfig(vocab_size=V, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                     max_context=64, logit_scale=1.5)  # fmt: skip
    return StubVerifier(cfg)


class ModelDrafter(ScriptedDrafter):
    """Drafts from a second, different stub model: a real proposal distribution q that is close to, but
    not equal to, the verifier's. Position i of the block gets the next-token logits rolled by i, a
    deterministic function of the context (as DFlash's per-position marginals are)."""

    name = "model"

    def __init__(self) -> None:
        super().__init__([], vocab=V, block_size=4)
        cfg = StubConfig(vocab_size=V, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                         max_context=64, logit_scale=1.5, seed=7)  # fmt: skip
        self.model = StubVerifier(cfg)

    def propose_logits(self, last_token: int, n: int) -> torch.Tensor:
        self.model.reset()
        nxt = self.model.forward([*self.tokens, last_token], last_only=True)[0]  # [V]
        return torch.stack([nxt.roll(i) for i in range(n)])  # [n, V]

    def propose(self, last_token: int, n: int) -> list[int]:
        return self.propose_logits(last_token, n).argmax(-1).tolist()

    def memory_probe(self):
        return probe_for_device("cpu")


def exact_joint(v: StubVerifier, sp: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | prompt) under plain sampling, by enumeration with full recompute."""

    def dist(prefix: Sequence[int]) -> torch.Tensor:
        v.reset()
        return warp(v.forward([*PROMPT, *prefix], last_only=True), sp)[0].double()  # [V]

    p1 = dist([])
    out = {}
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = dist([a])
        for b in range(V):
            if p2[b] == 0:
                continue
            p3 = dist([a, b])
            for c in range(V):
                out[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return out


def chi2_threshold(df: int, alpha: float) -> float:
    """Wilson-Hilferty approximation of the chi-square (1 - alpha) quantile."""
    z = {1e-3: 3.090, 1e-4: 3.719}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: Counter, expected: dict[tuple[int, ...], float], n: int) -> tuple[float, int]:
    """Chi-square statistic with bins of expected count < 5 pooled into one; returns (stat, df)."""
    big = {k: p for k, p in expected.items() if p * n >= 5}
    stat = sum((counts.get(k, 0) - p * n) ** 2 / (p * n) for k, p in big.items())
    rest_p = 1 - sum(big.values())
    rest_n = n - sum(counts.get(k, 0) for k in big)
    bins = len(big)
    if rest_p * n >= 1:
        stat += (rest_n - rest_p * n) ** 2 / (rest_p * n)
        bins += 1
    elif rest_n > 0:
        stat = float("inf")  # samples where the exact distribution puts (almost) no mass
    return stat, bins - 1


def sample_joint(
    v: StubVerifier, sp: SamplingParams, block_size: int, drafter=None, n: int = N_SAMPLES
) -> Counter:
    """The first three tokens of `n` seeded runs (drafter None: the test's own model drafter)."""
    if drafter is None:
        drafter = ModelDrafter() if block_size > 1 else None
    counts: Counter = Counter()
    for seed in range(n):
        cfg = DecodeConfig(max_new_tokens=3, block_size=block_size, stop_token_ids=frozenset(),
                           sampling=SamplingParams(**{**sp.__dict__, "seed": seed}))  # fmt: skip
        counts[tuple(generate(v, PROMPT, drafter=drafter, cfg=cfg).output_tokens)] += 1
    return counts


def check_walk_distribution(
    v: StubVerifier, drafter, walker: type, monkeypatch, *, broken: bool, reference=None, n: int = N_WALK
) -> None:
    """Chi-square of the first three tokens against the exact distribution (enumerated with `reference`'s
    forward, default `v`'s), drafts sampled from the drafter's walk and verified by `rejection`. `broken`,
    the negative control: the walk (`walker`'s `propose_walk`) reports its q rows shifted by one token,
    which must fail."""
    if broken:
        real = walker.propose_walk

        def shifted(self, *a, **kw):
            tokens, q = real(self, *a, **kw)
            return tokens, q.roll(1, dims=-1)

        monkeypatch.setattr(walker, "propose_walk", shifted)
    sp = SamplingParams(temperature=1.0, rule="rejection", proposal="sample")
    stat, df = chi2_stat(sample_joint(v, sp, 4, drafter, n=n), exact_joint(reference or v, sp), n)
    limit = chi2_threshold(df, 1e-3)
    print(f"chi-square {stat:.1f} against {limit:.1f} (df {df}, {n} samples)")
    assert (stat > limit) if broken else (stat < limit), (stat, limit, df)


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
]


FAST = {("rejection", "sample", 0), ("match", "argmax", 1)}  # the rest of the matrix is marked slow


@pytest.mark.parametrize(
    ("rule", "proposal", "setting"),
    [
        pytest.param(
            rule,
            proposal,
            SETTINGS[i],
            id=f"{rule}-{proposal}-" + ",".join(f"{k}={v}" for k, v in SETTINGS[i].items()),
            marks=() if (rule, proposal, i) in FAST else pytest.mark.slow,
        )
        for rule in ("match", "rejection")
        for proposal in ("argmax", "sample")
        for i in range(len(SETTINGS))
        # the match rule ignores q; rejection of argmax drafts (q one-hot) warps p only, as match does:
        # each warper runs with the rule on p alone (match) and with a sampled q (rejection)
        if i == 0 or (rule, proposal) in {("match", "argmax"), ("rejection", "sample")}
    ],
)
def test_distribution_is_exact(verifier, rule, proposal, setting):
    sp = SamplingParams(rule=rule, proposal=proposal, **setting)
    expected = exact_joint(verifier, sp)
    counts = sample_joint(verifier, sp, block_size=4)
    stat, df = chi2_stat(counts, expected, N_SAMPLES)
    assert stat < chi2_threshold(df, ALPHA), (stat, df, counts.most_common(5))


def test_broken_rule_fails_the_same_test(verifier, monkeypatch):
    """Resampling from p instead of the residual on rejection over-weights the draft: caught."""

    def broken_verify(self, logits, draft, q, pos, *, cut=None):
        p = warp(logits, self.sp)
        out, self.resampled = [], 0
        for i, x in enumerate(draft):
            qx = q[i, x] if q is not None else 1.0
            if self.u(1, pos + i, 1, p)[0] * qx >= p[i, x]:  # rejected...
                tok = int(sample_from(p[i : i + 1], self.u(2, pos + i, 1, p)))  # ...but resampled from p
                if tok != x:
                    return [*out, tok]
            out.append(x)
        return [*out, int(sample_from(p[-1:], self.u(0, pos + len(draft), 1, p)))]

    monkeypatch.setattr(Sampler, "verify", broken_verify)
    sp = SamplingParams(rule="rejection", proposal="sample", temperature=1.0)
    counts = sample_joint(verifier, sp, block_size=4)
    stat, df = chi2_stat(counts, exact_joint(verifier, sp), N_SAMPLES)
    assert stat > chi2_threshold(df, ALPHA), (stat, df)


def test_match_rule_same_seed_same_output_with_or_without_speculation(verifier):
    for seed in range(20):
        sp = SamplingParams(temperature=1.0, seed=seed)
        cfg = dict(max_new_tokens=12, stop_token_ids=frozenset(), sampling=sp)
        ar = generate(verifier, PROMPT, cfg=DecodeConfig(block_size=1, **cfg)).output_tokens
        spec = generate(verifier, PROMPT, drafter=ModelDrafter(), cfg=DecodeConfig(block_size=4, **cfg))
        assert spec.output_tokens == ar
        assert all(s.rule == "match" for s in spec.steps)


def test_seeded_reproducibility_rejection(verifier):
    def run(seed: int) -> list[int]:
        sp = SamplingParams(temperature=1.0, seed=seed, rule="rejection", proposal="sample")
        cfg = DecodeConfig(max_new_tokens=12, block_size=4, stop_token_ids=frozenset(), sampling=sp)
        res = generate(verifier, PROMPT, drafter=ModelDrafter(), cfg=cfg)
        assert all(s.residual_resamples in (0, 1) for s in res.decode_steps)
        return res.output_tokens

    assert run(3) == run(3)
    assert len({tuple(run(s)) for s in range(6)}) > 1


def test_temperature_zero_and_limit_are_greedy(verifier):
    cfg = dict(max_new_tokens=16, stop_token_ids=frozenset())
    greedy = generate(verifier, PROMPT, cfg=DecodeConfig(block_size=1, **cfg)).output_tokens
    zero = DecodeConfig(block_size=4, sampling=SamplingParams(temperature=0.0), **cfg)
    t0 = generate(verifier, PROMPT, drafter=ModelDrafter(), cfg=zero)
    assert t0.output_tokens == greedy and all(s.rule == "greedy" for s in t0.steps)
    for rule in ("match", "rejection"):
        sp = SamplingParams(temperature=1e-4, rule=rule, seed=5)
        cold = generate(
            verifier, PROMPT, drafter=ModelDrafter(), cfg=DecodeConfig(block_size=4, sampling=sp, **cfg)
        )
        assert cold.output_tokens == greedy


def test_warp_matches_hand_computation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]])
    p = torch.softmax(logits / 0.5, -1)
    torch.testing.assert_close(warp(logits, SamplingParams(temperature=0.5)), p)
    top2 = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[0, 2:] == 0).all() and torch.isclose(top2.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]
    nucleus = warp(logits, SamplingParams(temperature=1.0, top_p=float(full[0] + full[1] / 2)))
    assert (nucleus[0, 2:] == 0).all() and nucleus[0, 1] > 0  # keeps the token that crosses top_p
    minp = warp(logits, SamplingParams(temperature=1.0, min_p=0.2))
    assert minp[0, 1] > 0 and (minp[0, 2:] == 0).all()  # e^-1 = 0.37 >= 0.2 of the max, e^-2 = 0.14 not
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]])
    draws = sample_from(probs.expand(1000, 4), torch.rand(1000, dtype=torch.float64))
    assert set(draws.tolist()) == {1, 3}


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
        (dict(seed=-1), "seed must be in"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be >= 0"),
        (dict(min_p=1.0), r"min_p must be in \[0, 1\)"),
        (dict(rule="typical"), "rule must be one of"),
        (dict(proposal="beam"), "proposal must be one of"),
    ],
)
def test_invalid_options(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_all_triples_enumerated(verifier):
    joint = exact_joint(verifier, SamplingParams(temperature=1.0))
    assert len(joint) == V**3 and abs(sum(joint.values()) - 1) < 1e-5  # fp32 warp
    assert set(joint) == set(itertools.product(range(V), repeat=3))
