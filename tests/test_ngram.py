"""`CorpusNgrams` against a plain-Python count of the same corpus."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from types import SimpleNamespace

import pytest

from specdec.drafting.lookup.ngrams import CorpusNgrams


def reference(seqs, max_order, min_count):
    """{context tuple: (next, share)} counted with dicts: most frequent next, ties to the smallest id."""
    counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for s in seqs:
        for j in range(len(s) - 1):
            for n in range(1, min(max_order, j + 1) + 1):
                counts[tuple(s[j - n + 1 : j + 1])][s[j + 1]] += 1
    out = {}
    for ctx, c in counts.items():
        total = sum(c.values())
        if total >= min_count:
            nxt, k = min(c.items(), key=lambda kv: (-kv[1], kv[0]))
            out[ctx] = (nxt, k / total)
    return out


@pytest.mark.parametrize("max_order,min_count", [(1, 1), (3, 1), (4, 2)])
def test_matches_a_plain_count(max_order, min_count):
    rng = random.Random(0)
    # a small vocabulary so contexts repeat; one-token and empty sequences contribute nothing
    seqs = [[rng.randrange(6) for _ in range(rng.randrange(0, 40))] for _ in range(30)] + [[3], []]
    ref = reference(seqs, max_order, min_count)
    table = CorpusNgrams(seqs, max_order=max_order, min_count=min_count)
    for ctx in {*ref, *((a, b) for a in range(7) for b in range(7))}:  # known contexts and unknown ones
        want = None  # the longest known suffix decides
        for n in range(min(max_order, len(ctx)), 0, -1):
            if ctx[-n:] in ref:
                want = ref[ctx[-n:]]
                break
        got = table.next(list(ctx))
        assert (got is None) == (want is None), ctx
        if got:
            assert got[0] == want[0] and got[1] == pytest.approx(want[1]), ctx


def test_no_context_crosses_a_sequence_boundary():
    table = CorpusNgrams([[1, 2], [3, 4]], max_order=2, min_count=1)
    assert table.next([2]) is None  # 2 ends a sequence: nothing follows it
    assert table.next([2, 3]) == (4, 1.0)  # the bigram (2, 3) never occurred; its suffix (3,) did


def test_chain_drafts_greedily_from_its_own_tokens():
    table = CorpusNgrams([[5, 1, 2, 3, 4], [9, 1, 2, 7]], max_order=2, min_count=1)
    # after 1: 2 (twice); after (1, 2): 3 or 7 once each -> 3; then 4; nothing follows 4
    assert table.chain([0, 1], 5) == [(2, 1.0), (3, 0.5), (4, 1.0)]
    assert table.chain([0, 1], 1) == [(2, 1.0)]
    assert table.chain([8], 3) == []
    long = CorpusNgrams([[1, 2, 3, 4, 5, 6, 7]], max_order=3, min_count=1)
    assert [t for t, _ in long.chain([9, 9, 9, 9, 1, 2], 4)] == [
        3,
        4,
        5,
        6,
    ]  # a context longer than max_order
    assert [t for t, _ in long.chain([2, 3, 4, 5, 6], 4)] == [7]


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_order"):
        CorpusNgrams([[1, 2]], max_order=0)


def test_large_ids_and_numpy_contexts():
    """Ids near a 262k vocabulary pack beside the context key; contexts may be numpy arrays (corpus ids)."""
    import numpy as np

    big = 262_143
    table = CorpusNgrams([[big, 7, big - 1, big, 7, big - 1]], max_order=3, min_count=1)
    assert table.next([big, 7]) == (big - 1, 1.0)
    assert table.chain(np.array([3, big], dtype=np.int64), 3) == [(7, 1.0), (big - 1, 1.0), (big, 1.0)]


def test_chain_stops_below_its_cut():
    table = CorpusNgrams([[5, 1, 2, 3, 4], [9, 1, 2, 7]], max_order=2, min_count=1)
    # running shares after [0, 1]: 2 (1.0), 3 (0.5), 4 (0.5)
    assert [t for t, _ in table.chain([0, 1], 5, cut=0.5)] == [2, 3, 4]
    assert [t for t, _ in table.chain([0, 1], 5, cut=0.6)] == [2]
    assert table.chain([0, 1], 5, cut=1.0) == [(2, 1.0)]


def test_calibration_scales_by_what_a_request_showed():
    from specdec.drafting.policy import Calibration

    cal = Calibration(prior=4.0)
    assert cal.factor("lookup") == 1.0 and cal.scale("lookup", [0.5, 0.9]) == [0.5, 0.9]
    cal.learn("lookup", [0.5, 0.5], accepted=2)  # both accepted: 2 tokens checked, 1/0.5 + 1/0.5 seen
    assert cal.factor("lookup") == pytest.approx((4 + 4) / (4 + 2))
    assert cal.scale("lookup", [0.5, 0.9]) == pytest.approx([0.5 * 8 / 6, 1.0])  # capped at 1
    cal.learn("corpus", [0.8, 0.8, 0.8], accepted=0)  # first rejected: 1 token checked, nothing accepted
    assert cal.factor("corpus") == pytest.approx(4 / 5)
    cal.learn("corpus", [0.8, 0.8, 0.8], accepted=1)  # second rejected: 2 checked
    assert cal.factor("corpus") == pytest.approx((4 + 1 / 0.8) / (4 + 1 + 2))
    assert cal.factor("lookup") == pytest.approx(8 / 6)  # sources are kept apart
    cal.reset()
    assert cal.factor("lookup") == cal.factor("corpus") == 1.0


def test_calibration_lengthens_a_cut_where_drafts_keep_being_accepted():
    from specdec.costs import VerifyCosts
    from specdec.drafting.lookup.prompt import lookup_accept
    from specdec.drafting.policy import Calibration, Draft, DraftPolicy

    policy = DraftPolicy(costs=VerifyCosts((1.0, 1.2, 1.5, 1.8, 2.1), "t"))
    cal = Calibration()
    lookup, nothing = Draft([1, 2, 3, 4], "lookup", lookup_accept(2, 4)), Draft([], "corpus")
    before = policy.choose(lookup, nothing, cal)
    assert before.source == "lookup" and len(before.tokens) < 4  # 2-gram chances 0.56, 0.63, ...: cut short
    for _ in range(20):
        cal.learn("lookup", policy.acceptance(before), accepted=len(before.tokens))
    after = policy.choose(lookup, nothing, cal)
    assert after == Draft([1, 2, 3, 4], "lookup", lookup_accept(2, 4))  # the chances come back uncalibrated
    cal.reset()
    for _ in range(40):  # every draft rejected at once: lookup stops being worth verifying
        cal.learn("lookup", policy.acceptance(before), accepted=0)
    assert policy.choose(lookup, nothing, cal) is None


def test_lookup_follows_the_longest_match():
    """`LookupFirstDrafter` proposes what followed the longest earlier match, not the latest short one, and
    prices it by that length (a match longer than the table's last row takes that row)."""
    from specdec.drafting.lookup.prompt import LOOKUP_ACCEPT, LOOKUP_NGRAMS, PromptLookupDrafter
    from specdec.drafting.lookup.prompt import lookup_accept as chances
    from specdec.drafting.mix import LookupFirstDrafter

    lookup = LookupFirstDrafter(PromptLookupDrafter(block_size=4), block_size=4).lookup
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 6, 7, 8, 30, 31]  # 6 7 8 recurs, but only 1..8 matches below
    lookup.extend(None, [*ctx, 1, 2, 3, 4, 5, 6, 7])
    assert lookup.match(8, 3) == ([9, 10, 20], 8)  # the 3-gram 6 7 8 alone would give 30 31
    assert chances(12, 2) == list(LOOKUP_ACCEPT[LOOKUP_NGRAMS[1]][:2])
    assert chances(3, 9)[6:] == [LOOKUP_ACCEPT[3][-1]] * 3  # a row's last chance repeats


def test_lookup_chances_are_what_the_bundled_corpus_shows(capsys):
    """`LOOKUP_ACCEPT` is reproducible: `python -m specdec.evals.chances` on the bundled corpus prints it,
    and loading that corpus for the engine measures the same."""
    from specdec.drafting.lookup.ngrams import check_corpus, load_corpus_ngrams
    from specdec.drafting.lookup.prompt import LOOKUP_ACCEPT
    from specdec.evals.chances import main

    corpus = "bundled:smollm2-135m"  # the folder shipped in the package, found from any directory
    assert main(["--corpus", corpus]) == 0
    assert eval("{" + capsys.readouterr().out + "}") == LOOKUP_ACCEPT
    verifier = SimpleNamespace(vocab_size=check_corpus(corpus)["vocab_size"])  # only its vocabulary is read
    assert load_corpus_ngrams(corpus, verifier).lookup_chances == LOOKUP_ACCEPT


def test_a_corpus_prices_lookup_by_its_own_chances():
    """`LookupFirstDrafter` with a corpus that carries lookup chances cuts lookup's drafts by them (a row
    it lacks falls back to `LOOKUP_ACCEPT`)."""
    from specdec.costs import VerifyCosts
    from specdec.drafting.lookup.prompt import LOOKUP_ACCEPT, PromptLookupDrafter, lookup_accept
    from specdec.drafting.mix import LookupFirstDrafter
    from specdec.drafting.policy import DraftPolicy

    costs = VerifyCosts.from_seconds({1: 1.0, 2: 1.0, 4: 1.1, 8: 1.3, 16: 2.0}, source="test")
    table = CorpusNgrams([[1, 2, 3]])
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]  # "5 6" recurs: a 2-gram match proposes 7 8 9 ...
    drafts = {}
    for name, chances in (("sure", {2: (1.0,)}), ("never", {2: (0.0,)}), ("default", None)):
        table.lookup_chances = chances
        policy = DraftPolicy(costs=costs)
        d = LookupFirstDrafter(PromptLookupDrafter(block_size=16), block_size=16, corpus=table, policy=policy)
        d.extend(None, ids[:-1])
        drafts[name] = d.propose(ids[-1], 15), max(d.counts, key=d.counts.get)  # (draft, its source)
    assert drafts["sure"] == ([7, 8, 9, 10, 11, 12, 5, 6], "lookup")
    assert drafts["never"][1] == "drafter"  # not worth verifying, the corpus has nothing: the wrapped one
    assert drafts["default"][1] == "lookup"  # no chances of its own: LOOKUP_ACCEPT's 2-gram row, worth it
    assert lookup_accept(2, 3, {3: (0.5,)}) == list(LOOKUP_ACCEPT[2][:3])


def test_lookup_chances_of_a_text_that_repeats_itself():
    from specdec.drafting.lookup.prompt import lookup_chances

    prompt = list(range(100, 140))
    got = lookup_chances([(prompt, prompt * 2)], min_tries=1)
    assert got[8] == (1.0,) * 6  # six chances per row at most
    assert all(c == 1.0 for row in got.values() for c in row)  # every draft of a repeat is accepted


def test_chances_cli_errors_are_one_line(tmp_path, capsys):
    from specdec.evals.chances import main

    assert main(["--corpus", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "is not a corpus (no corpus.json)" in err and len(err.strip().splitlines()) == 1
    assert main(["--corpus", str(tmp_path), "--answers", "0"]) == 2
    assert "argument --answers: must be >= 1, got 0" in capsys.readouterr().err
