"""What is equal to what in bf16: our verifier's greedy text against transformers' own bf16 `generate` (and
both against fp32), with where and why they part.

    python -m specdec.evals.bf16_vs_runtime --model smollm2-135m --limit 5 --max-new-tokens 64

Per prompt (HumanEval): our bf16 speculative (the bundled drafter) against our bf16 AR, bit for bit by
construction where the verify is batch-invariant; our bf16 AR against transformers' bf16 `generate`, and
at the first token where they part, the logits of both tokens as our one-token step saw them, as
`generate` saw them, and as transformers' own forward over the whole context sees them; our fp32 AR
against transformers' fp32 `generate`. Then, teacher-forced over our bf16 answers, how often each bf16
argmax agrees with the fp32 model's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch


def compare(model: str, *, limit: int, max_new_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from specdec.api import load_drafter
    from specdec.chat import encode_prompt
    from specdec.engine import decode_config, generate
    from specdec.evals.datasets import load_dataset
    from specdec.models import resolve_model
    from specdec.verifiers.hf import HFVerifier

    path = resolve_model(model)
    ours = {d: HFVerifier(path, dtype=d) for d in (torch.bfloat16, torch.float32)}
    theirs = {d: AutoModelForCausalLM.from_pretrained(path, dtype=d).eval() for d in ours}
    drafter = load_drafter(f"bundled:{model}", verifier=ours[torch.bfloat16], dtype="bfloat16")
    ar_cfg = decode_config(None, max_new_tokens=max_new_tokens)
    rows, agree = [], {"ours_bf16": 0, "runtime_bf16": 0, "positions": 0}
    for rec in load_dataset("humaneval", limit):
        prompt = encode_prompt(ours[torch.bfloat16], rec.messages)
        ar = {d: generate(v, prompt, cfg=ar_cfg).output_tokens for d, v in ours.items()}
        spec_cfg = decode_config(drafter, max_new_tokens=max_new_tokens)
        spec = generate(ours[torch.bfloat16], prompt, drafter=drafter, cfg=spec_cfg).output_tokens
        row: dict[str, Any] = {"id": rec.id, "bf16_spec_equals_our_ar": spec == ar[torch.bfloat16]}
        for d, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            gen, scores = _runtime_generate(theirs[d], prompt, max_new_tokens)
            i = next((i for i, (a, b) in enumerate(zip(ar[d], gen)) if a != b), None)
            row[f"{name}_equals_generate"] = i is None
            if i is not None:
                row[f"{name}_first_difference"] = _difference(
                    ours[d], theirs[d], prompt, ar[d], gen, scores, i
                )
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        ids = prompt + ar[torch.bfloat16]
        with torch.inference_mode():
            exact = theirs[torch.float32](torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].argmax(-1)
            rt = theirs[torch.bfloat16](torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].argmax(-1)
        mine = torch.tensor(ar[torch.bfloat16])  # our bf16 argmax at each position, on our own text
        agree["ours_bf16"] += int((mine == exact).sum())
        agree["runtime_bf16"] += int((rt == exact).sum())
        agree["positions"] += len(mine)
    return {"model": model, "prompts": rows, "argmax_agreement_with_fp32": agree}


def _runtime_generate(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list]:
    """transformers' greedy `generate`: its tokens and the logits [V] it chose each one from."""
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [s[0].float() for s in out.logits]


def _difference(
    v: Any, model: Any, prompt: list[int], ours: list[int], gen: list[int], scores: list, i: int
) -> dict:
    """At the first differing token i, the logits of [our token, generate's token]: in our AR's one-token
    step, in generate's step, and in transformers' own forward over the whole context (its generate and
    its forward are not the same computation in bf16 either)."""
    ctx = prompt + ours[:i]
    v.set_target_layers(())
    v.reset()
    v.forward(ctx[:-1])
    mine = v.forward(ctx[-1:])[-1].float()  # as our AR computed it: a one-token step after the rest
    v.reset()
    with torch.inference_mode():
        forward = model(torch.tensor([ctx])).logits[0, -1].float()

    def pair(x: torch.Tensor) -> list[float]:
        return [float(x[ours[i]]), float(x[gen[i]])]

    return {
        "token": i, "ours": ours[i], "generate": gen[i], "our_step": pair(mine),
        "generate_step": pair(scores[i]), "runtime_forward": pair(forward),
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdec.evals.bf16_vs_runtime", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--limit", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    print(json.dumps(compare(args.model, limit=args.limit, max_new_tokens=args.max_new_tokens), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
