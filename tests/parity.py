"""Exactness against the runtime itself: our verifier's logits and greedy text next to transformers' own
forward and `generate` in the same dtype, not only next to our own autoregressive decoding (which shares
any bug of our verifier: a bf16 prefill that was not causal passed every spec == AR test).

In bf16 / fp16 two correct implementations differ by rounding, so "like the runtime" is measured against
the model in fp32: our typical error may be at most twice the runtime's own (plus a hair), and wherever
the runtime's top-1 leads its top-2 by more than both errors together, our argmax must be its argmax.
"""

from __future__ import annotations

import torch


def runtime_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' own teacher-forced forward over `ids`, as loaded: [T, V] fp32."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def our_logits(v, prompt: list[int], steps: list[int], block: list[int]) -> torch.Tensor:
    """Our verifier over prompt + steps + block as a prefill, one-token steps, then one verify: [T, V]."""
    v.set_target_layers(())
    v.reset()
    out = [v.forward(prompt), *(v.forward([t]) for t in steps), v.forward(block)]
    v.reset()
    return torch.cat(out).float()


def assert_like_runtime(ours: torch.Tensor, runtime: torch.Tensor, exact: torch.Tensor) -> None:
    """`ours` and `runtime` [T, V] in the same low dtype, `exact` the fp32 model's [T, V]. Errors are per
    position (max over the vocabulary) and compared by their median: a MoE router that rounds to another
    expert at one position moves that position's logits far in either implementation."""
    err = (ours - exact).abs().amax(-1)  # [T]
    err_rt = (runtime - exact).abs().amax(-1)  # [T]
    med, med_rt = err.median().item(), err_rt.median().item()
    assert med <= 2 * med_rt + 1e-3, f"our median error {med:.4g} vs the runtime's own {med_rt:.4g}"
    top2 = runtime.topk(2, -1).values  # [T, 2]
    sure = top2[:, 0] - top2[:, 1] > err + err_rt  # no rounding of either side can flip these
    assert sure.any(), "no position decides: the check would be vacuous"
    bad = (ours.argmax(-1) != runtime.argmax(-1)) & sure
    assert not bad.any(), (
        f"argmax differs from the runtime's at decided positions {bad.nonzero()[:, 0].tolist()}"
    )


def runtime_generate(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy `generate`, `n` new tokens."""
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def mlx_lm_greedy(v, prompt: list[int], n: int) -> list[int]:
    """mlx_lm's own greedy loop (`generate_step`, its own caches: RotatingKVCache on Gemma's sliding layers)
    over MLXVerifier `v`'s model, `n` new tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    gen = generate_step(mx.array(prompt), v.model, max_tokens=n, sampler=lambda lp: mx.argmax(lp, axis=-1))
    return [int(t) for t, _ in gen]


def assert_same_text_up_to_ties(
    ours: list[int], theirs: list[int], model: torch.nn.Module, prompt: list[int], *, exact: torch.nn.Module,
    tie: float, agree: int, partings: int = 3,
) -> int:  # fmt: skip
    """Our greedy tokens are the runtime's own greedy text up to near-ties: they equal its `generate`
    (`theirs`, by `model` in the low dtype) for at least `agree` tokens, and wherever they part the model
    itself (`exact`: in fp32) does not prefer the runtime's token to ours by more than `tie`, or twice the
    runtime's own error against it at that position (a rounding choice between near-equal candidates,
    not a different model); from each parting the runtime's greedy
    text is generated again after our token and compared on, so every token of ours is checked, at most
    `partings` times apart. How many tokens agree before the first parting."""
    first, at, theirs = None, 0, list(theirs)
    for _ in range(partings + 1):
        n = at + next((i for i, (a, b) in enumerate(zip(ours[at:], theirs)) if a != b), len(ours) - at)
        if n >= len(ours):
            return len(ours) if first is None else first
        first = n if first is None else first
        assert first >= agree, f"our text parts from the runtime's at token {first}, before {agree}"
        logits = runtime_logits(exact, prompt + ours[:n])[-1]  # the model at the parting position
        gap = (logits[theirs[n - at]] - logits[ours[n]]).item()
        own = (runtime_logits(model, prompt + ours[:n])[-1] - logits).abs().max().item()
        assert gap <= max(tie, 2 * own), (  # the runtime's own error there: a MoE router's flip moves far
            f"token {n}: we chose {ours[n]}, the runtime {theirs[n - at]}, {gap:.3g} better in fp32 (the "
            f"runtime's own error there {own:.3g})"
        )
        at = n + 1  # the runtime again, after our token
        theirs = runtime_generate(model, prompt + ours[:at], len(ours) - at) if at < len(ours) else []
    raise AssertionError(f"our text parts from the runtime's more than {partings} times")
