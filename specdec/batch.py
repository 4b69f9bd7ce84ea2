"""Several requests decoding at once on one loaded model, their verifies run together.

Each request runs the engine's own decode loop (`engine.decode`: its drafter, sampler, stop tokens, the
same steps as alone) on a sequence of a batch (`batch_of`: `verifiers.hf_batch.HFBatch`,
`verifiers.mlx_batch.MLXBatch` or `verifiers.stub_batch.StubBatch`), on a thread of its own, a member of
the batch while it decodes; the batch runs the calls its members have waiting in one forward. Requests
join whenever they start and leave when they finish or are cancelled (continuous batching); each gets
what it gets alone, token for token, because the batch gives each call the logits it gets alone
(measured when the batch is made, or the batch is refused).

    batch = batch_of(load_verifier("hf", "smollm2-135m", dtype="bfloat16"))
    results = generate_many(batch, [Request(prompt=a, cfg=cfg, drafter=d1), Request(prompt=b, cfg=cfg)])
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specdec.engine import DecodeConfig, generate
from specdec.protocols import Drafter
from specdec.records import PromptResult

__all__ = ["Request", "batch_of", "generate_many"]


@dataclass(frozen=True, kw_only=True)
class Request:
    """One request of a batch: its prompt, how it decodes, its own drafter (a drafter's context is one
    request's: give each request its own), and an event that cancels it between steps."""

    prompt: Sequence[int]
    cfg: DecodeConfig
    drafter: Drafter | None = None
    cancel: threading.Event | None = None
    prompt_id: str = "0"


def batch_of(verifier: Any) -> Any:
    """A batch over the loaded `verifier` (HF, MLX or the stub): it measures, on the model here, that calls
    run together give what they give alone, or refuses in one line (ValueError) why they cannot."""
    if verifier.runtime == "hf":
        from specdec.verifiers.hf_batch import HFBatch

        return HFBatch(verifier)
    if verifier.runtime == "mlx":
        from specdec.verifiers.mlx_batch import MLXBatch

        return MLXBatch(verifier)
    if verifier.runtime == "stub":
        from specdec.verifiers.stub_batch import StubBatch

        return StubBatch(verifier)
    raise ValueError(f"the {verifier.runtime} verifier cannot verify several sequences in one forward")


def generate_many(batch: Any, requests: Sequence[Request]) -> list[PromptResult | BaseException]:
    """Run `requests` at once on `batch` (module docstring): each request's result, or the exception it
    raised (a request's error stays its own; the others run on)."""
    drafters = [id(r.drafter) for r in requests if r.drafter is not None]
    if len(set(drafters)) != len(drafters):
        raise ValueError("two requests share one drafter object: give each request its own drafter")
    out: list[PromptResult | BaseException] = [RuntimeError("not run")] * len(requests)

    def run(i: int, r: Request) -> None:
        try:  # a member of the batch while it decodes (`engine.decode`)
            seq = batch.sequence()
            if r.drafter is not None:  # drafters that read the verifier (its K/V, its states) read this one
                r.drafter.bind(seq)
            out[i] = generate(
                seq, r.prompt, drafter=r.drafter, cfg=r.cfg, prompt_id=r.prompt_id, cancel=r.cancel
            )
        except Exception as e:  # reported in its slot: one request's error does not stop the others
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, r), daemon=True) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
