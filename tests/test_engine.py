"""The decode loop against slow references on the stub verifier."""

from __future__ import annotations

import pytest
import torch
from drafters import RandomDrafter, ScriptedDrafter, greedy_reference

from specdec.engine import DecodeConfig, common_prefix_len, generate
from specdec.verifiers.stub import StubConfig, StubVerifier

LAYERS = (0, 2, 3)


@pytest.fixture(scope="module")
def verifier() -> StubVerifier:
    return StubVerifier(StubConfig(max_context=512))


def prompt_of(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def refs(verifier: StubVerifier) -> dict[int, list[int]]:
    return {n: greedy_reference(verifier, prompt_of(n), 40) for n in (1, 5, 33)}


def make_drafter(kind: str, prompt: list[int], ref: list[int], bs: int, v: StubVerifier):
    kw = dict(vocab=v.vocab_size, block_size=bs, target_layer_ids=LAYERS, hidden_size=v.hidden_size)
    if kind == "all":
        return ScriptedDrafter(prompt + ref, **kw)
    if kind == "none":
        return RandomDrafter(seed=3, **kw)
    wrong = {len(prompt) + i for i in (1, 2, 6, 13, 14, 15, 22)}  # scattered and consecutive misses
    return ScriptedDrafter(prompt + ref, wrong_at=wrong, **kw)


@pytest.mark.parametrize("kind", ["all", "none", "part"])
@pytest.mark.parametrize("bs", [1, 2, 4, 16])
@pytest.mark.parametrize("plen", [1, 5, 33])
def test_greedy_equivalence(verifier, refs, kind, bs, plen):
    prompt, ref = prompt_of(plen), refs[plen]
    drafter = make_drafter(kind, prompt, ref, bs, verifier)
    res = generate(
        verifier,
        prompt,
        drafter=drafter,
        cfg=DecodeConfig(max_new_tokens=37, block_size=bs, stop_token_ids=frozenset()),
    )
    assert res.output_tokens == ref[:37]
    assert res.finish_reason == "length"
    steps = res.decode_steps
    if kind == "all" and bs > 1:
        # every draft accepted; max_new_tokens=37 cuts inside the last block
        assert all(s.accepted == s.drafted for s in steps)
        assert len(steps) == -(-36 // bs)
    if kind == "none" and bs > 1:
        assert sum(s.accepted for s in steps) <= 2
    if kind == "part" and bs > 2:
        assert 0 < sum(s.accepted for s in steps) < sum(s.drafted for s in steps)
    assert all(s.acceptance_length == s.accepted + 1 for s in steps)
    assert sum(len(s.tokens) for s in res.steps) == 37
    if bs > 1:
        # the drafter saw exactly the committed positions, with the verifier's own features
        full = torch.cat(drafter.features)  # [P + n, K*H]
        seq = prompt + ref[:37]
        assert drafter.tokens == seq[: full.shape[0]]
        verifier.set_target_layers(LAYERS)
        verifier.reset()
        verifier.prefill(seq[: full.shape[0]])
        torch.testing.assert_close(full, verifier.features(full.shape[0], device="cpu", dtype=torch.float32))


@pytest.mark.parametrize("bs", [1, 3, 16])
def test_stop_token_inside_block(verifier, refs, bs):
    prompt, ref = prompt_of(33), refs[33]
    stop = ref[9]
    first = ref.index(stop)
    drafter = make_drafter("all", prompt, ref, bs, verifier)
    res = generate(
        verifier,
        prompt,
        drafter=drafter,
        cfg=DecodeConfig(max_new_tokens=40, block_size=bs, stop_token_ids=frozenset({stop})),
    )
    assert res.output_tokens == ref[: first + 1]
    assert res.finish_reason == "stop"


def test_stop_on_first_token(verifier, refs):
    prompt, ref = prompt_of(5), refs[5]
    res = generate(verifier, prompt, cfg=DecodeConfig(max_new_tokens=9, stop_token_ids=frozenset({ref[0]})))
    assert res.output_tokens == ref[:1] and res.finish_reason == "stop" and len(res.steps) == 1


def test_max_new_tokens_one(verifier, refs):
    res = generate(verifier, prompt_of(5), cfg=DecodeConfig(max_new_tokens=1, stop_token_ids=frozenset()))
    assert res.output_tokens == refs[5][:1] and res.finish_reason == "length"


@pytest.mark.parametrize("bs", [1, 4])
def test_context_limit(refs, bs):
    v = StubVerifier(StubConfig(max_context=40))
    prompt, ref = prompt_of(33), refs[33]
    drafter = make_drafter("all", prompt, ref, bs, v)
    res = generate(
        v,
        prompt,
        drafter=drafter,
        cfg=DecodeConfig(max_new_tokens=30, block_size=bs, stop_token_ids=frozenset()),
    )
    assert res.finish_reason == "context"
    # the last token is predicted from position 39: the output fills the context plus one
    assert res.output_tokens == ref[: 40 - 33 + 1]
    assert v.position <= 40


def test_rollback_then_repeat_identical(verifier):
    verifier.set_target_layers(LAYERS)
    verifier.reset()
    verifier.prefill(prompt_of(20))
    for n in (8, 3, 1):
        p0, block = verifier.position, prompt_of(n, seed=9 + n)
        a = verifier.forward(block).clone()
        fa = verifier.features(n, device="cpu", dtype=torch.float32).clone()
        assert verifier.position == p0 + n
        verifier.rollback(n)
        assert verifier.position == p0
        b = verifier.forward(block)  # same shapes, same kernels: bit-identical
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(
            verifier.features(n, device="cpu", dtype=torch.float32), fa, rtol=0, atol=0
        )
        verifier.rollback(n // 2)  # keep part of it: offsets move on consistently
        assert verifier.position == p0 + n - n // 2
    with pytest.raises(ValueError, match="roll back"):
        verifier.rollback(verifier.position + 1)


def test_common_prefix_len():
    assert common_prefix_len([], [5]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [1, 9, 3, 4]) == 1
    assert common_prefix_len([7], [1, 2]) == 0


def test_records_timings_and_memory(verifier, refs):
    prompt, ref = prompt_of(5), refs[5]
    res = generate(
        verifier,
        prompt,
        drafter=make_drafter("part", prompt, ref, 4, verifier),
        cfg=DecodeConfig(max_new_tokens=20, block_size=4),
    )
    for s in res.steps:
        assert s.step_s > 0 and s.verify_s > 0 and s.draft_s >= 0 and s.bridge_s >= 0
        assert s.other_s > -1e-6
        assert abs(s.draft_s + s.verify_s + s.bridge_s + s.other_s - s.step_s) < 1e-6
        assert set(s.peak_memory) == {"verifier", "drafter"}
        assert s.peak_memory["verifier"]["bytes"] is None or s.peak_memory["verifier"]["bytes"] > 0
    assert res.text is not None


@pytest.mark.parametrize("bs", [2, 8, 16])
def test_prompt_lookup_drafter_exact(verifier, bs):
    from specdec.drafting.lookup.prompt import PromptLookupDrafter

    prompt = verifier.tokenizer.encode("the cat sat on the mat; the cat sat on the")
    ar = generate(verifier, prompt, cfg=DecodeConfig(max_new_tokens=60, block_size=1))
    spec = generate(verifier, prompt, drafter=PromptLookupDrafter(block_size=bs),
                    cfg=DecodeConfig(max_new_tokens=60, block_size=bs))  # fmt: skip
    assert spec.output_tokens == ar.output_tokens
    assert sum(s.accepted for s in spec.decode_steps) > 0  # the stub loops, lookup finds it
    assert len(spec.decode_steps) < len(ar.decode_steps)


def test_prompt_lookup_rollback():
    from specdec.drafting.lookup.prompt import PromptLookupDrafter

    d = PromptLookupDrafter(block_size=8)
    d.extend(torch.empty(6, 0), [1, 2, 3, 1, 2, 3])
    assert d.propose(1, 4) == [2, 3, 1]  # the match runs into the present: only `last` is known after it
    d.rollback(3)
    assert d.context_len == 3 and d.propose(1, 4) == [2, 3, 1]
    assert d.propose(9, 4) == []
