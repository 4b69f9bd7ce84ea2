"""The HF verifier in bf16 / fp16 computes the model transformers computes, for every family we support:
prefill, one-token steps and a verify against transformers' own forward in that dtype, and greedy text
against its own `generate` (see tests/parity.py for what "the same" means in a low dtype). A verifier
whose prefill let positions see later ones passed every spec == AR test and fails these.

Where the verify is batch-invariant on the loaded model (measured at load), speculative output equals our
autoregressive output token for token with drafters that accept all, none and a scripted part.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tinymodels
import torch
from drafters import RandomDrafter, ScriptedDrafter
from parity import (
    assert_like_runtime,
    assert_same_text_up_to_ties,
    our_logits,
    runtime_generate,
    runtime_logits,
)

from specdec.engine import DecodeConfig, generate

transformers = pytest.importorskip("transformers")
from specdec.verifiers.hf import HFVerifier  # noqa: E402

pytestmark = pytest.mark.hf

MAKERS = {
    "llama": tinymodels.tiny_llama,
    "gemma3": tinymodels.tiny_gemma3,
    "gemma4": tinymodels.tiny_gemma4,
    "gemma4_moe": lambda p: tinymodels.tiny_gemma4(p, moe=True),
    "qwen3": tinymodels.tiny_qwen3,
    "qwen3_moe": lambda p: tinymodels.tiny_qwen3(p, moe=True),
}
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
PROMPT = [(7 * i) % 300 + 3 for i in range(40)]  # past every sliding window (16)
STEPS = [(11 * i) % 300 + 3 for i in range(12)]
BLOCK = [(13 * i) % 300 + 3 for i in range(8)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parity")
    return {fam: make(root / fam) for fam, make in MAKERS.items()}


def _runtime(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("fam", MAKERS)
def test_logits_match_the_runtime(paths, fam, dtype):
    v = HFVerifier(paths[fam], dtype=dtype)
    ids = PROMPT + STEPS + BLOCK
    ours = our_logits(v, PROMPT, STEPS, BLOCK)  # prefill, 12 one-token steps, a verify of 8
    assert_like_runtime(
        ours,
        runtime_logits(_runtime(paths[fam], dtype), ids),
        runtime_logits(_runtime(paths[fam], torch.float32), ids),
    )


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("fam", MAKERS)
def test_greedy_text_matches_runtime_generate(paths, fam, dtype):
    v, rt = HFVerifier(paths[fam], dtype=dtype), _runtime(paths[fam], dtype)
    n = 24
    ours = generate(v, PROMPT, cfg=DecodeConfig(max_new_tokens=n, block_size=1)).output_tokens
    theirs = runtime_generate(rt, PROMPT, n)
    # a near-tie: the fp32 model's own margin within what bf16 rounding moves a logit here (~0.06). These
    # random models' top logits lie within ~0.1 of each other, so a parting may come at any token; every
    # token after it is checked again. MoE routers flip on a rounding besides: there every token may part
    exact = _runtime(paths[fam], torch.float32)
    partings = n if fam.endswith("moe") else 3
    assert_same_text_up_to_ties(ours, theirs, rt, PROMPT, exact=exact, tie=0.1, agree=0, partings=partings)
    if v.batch_invariant:  # measured on this model here: then speculation is exact too
        kw = dict(vocab=v.vocab_size, block_size=6)
        for d in (
            ScriptedDrafter(PROMPT + ours, **kw),
            RandomDrafter(vocab=v.vocab_size, seed=3, block_size=6),
            ScriptedDrafter(PROMPT + ours, wrong_at=range(len(PROMPT) + 2, len(PROMPT) + n, 3), **kw),
        ):
            got = generate(v, PROMPT, drafter=d, cfg=DecodeConfig(max_new_tokens=n, block_size=6))
            assert got.output_tokens == ours


def test_training_features_are_causal(paths):
    """`batch_features` runs the model without a cache or a mask (transformers then relies on is_causal):
    a position's features must not depend on the tokens after it."""
    v = HFVerifier(paths["llama"], dtype=torch.bfloat16)
    ids = torch.tensor([PROMPT, PROMPT[:20] + STEPS + BLOCK])  # [2, 40]: equal first 20 tokens
    feats, _, _ = v.batch_features(ids, (1, 3))
    assert torch.equal(feats[0, :20], feats[1, :20])


def test_a_reused_prefix_equals_a_fresh_prefill_in_bf16(tmp_path):
    """A later turn prefills only its new tokens after a cached prefix; a fresh run prefills everything
    on an empty cache (the call transformers passes no mask for). With a non-causal fresh prefill the
    two disagreed (a server's answer changed after an unrelated request, SmolLM2-135M bf16)."""
    from specdec.drafting.lookup.prompt import PromptLookupDrafter
    from specdec.stream import StreamingEngine

    v = HFVerifier(tinymodels.tiny_tokenizer(tinymodels.tiny_llama(tmp_path / "m")), dtype=torch.bfloat16)
    engine, fresh = (StreamingEngine(v, PromptLookupDrafter(block_size=4), reuse=r) for r in (True, False))
    first = engine.complete(PROMPT, max_tokens=12)
    follow = PROMPT + first.output_tokens + STEPS
    again = engine.complete(follow, max_tokens=12)
    assert again.reused_tokens > len(PROMPT) // 2
    assert again.output_tokens == fresh.complete(follow, max_tokens=12).output_tokens


def test_the_text_check_fails_texts_that_are_not_the_runtimes(paths):
    """`assert_same_text_up_to_ties` itself: a text that parts before `agree`, one that takes a token the
    model does not nearly tie with the runtime's, and one that parts at a near-tie and then goes its own
    way all fail; the runtime's own text passes (callers used to pass texts parting at token 0)."""
    rt, exact = _runtime(paths["llama"], torch.bfloat16), _runtime(paths["llama"], torch.float32)
    theirs = runtime_generate(rt, PROMPT, 12)

    def check(ours: list[int], *, tie: float = 0.1, agree: int = 4) -> int:
        return assert_same_text_up_to_ties(ours, theirs, rt, PROMPT, exact=exact, tie=tie, agree=agree)

    assert check(theirs) == 12
    second = int(runtime_logits(rt, PROMPT)[-1].topk(2).indices[1])  # the runtime's runner-up at token 0
    early = [second, *runtime_generate(rt, [*PROMPT, second], 11)]
    with pytest.raises(AssertionError, match="at token 0, before 4"):
        check(early)
    worst = int(runtime_logits(exact, PROMPT + theirs[:6])[-1].argmin())
    with pytest.raises(AssertionError, match="token 6: we chose"):
        check([*theirs[:6], worst, *theirs[7:]])
    e0 = runtime_logits(exact, PROMPT)[-1]
    tie = max(0.0, float(e0[theirs[0]] - e0[second])) + 1e-3  # token 0's parting is a near-tie now
    assert check(early, tie=tie, agree=0) == 0
    own = early[:6]  # then a token of our own, after the runtime's text from the parting on
    bad = int(runtime_logits(exact, PROMPT + own)[-1].argmin())
    with pytest.raises(AssertionError, match="token 6: we chose"):
        check([*own, bad, *runtime_generate(rt, [*PROMPT, *own, bad], 5)], tie=tie, agree=0)
