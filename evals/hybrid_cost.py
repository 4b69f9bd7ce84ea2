"""What exact rollback of Gated DeltaNet layers costs, next to the verify itself: random Qwen3.5-shaped
hybrids (3 Gated DeltaNet layers to 1 gated attention layer, fp32), both verifiers, on this machine.

    python -m specdec.evals.hybrid_cost --out hybrid_cost.json

For each size and runtime, after a 64-token prompt, `--steps` rounds of: a verify of 8 tokens, then a
rollback of `--reject` of them (the rejected drafts). Timed apart, each ending at a sync point:
- `verify_ms`: the verify as the engine runs it (recording what its rollback needs);
- `plain_verify_ms`: the same verify with the rollback machinery off (HF: transformers' chunked kernel,
  which cannot be rolled back; MLX: no projection taps), the cost the machinery is measured against;
- `rollback_ms`: the rollback (HF: picking the kept state; MLX: restoring it and replaying the accepted
  prefix's recurrence, evaluated here to be timed; the engine starts it asynchronously);
- `held_bytes`: what the recording keeps alive between the verify and its rollback beyond the cache
  itself (HF: the per-position states and conv inputs; MLX: the projection outputs and the layer inputs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.args import Parser, at_least, run_main

#: name -> (hidden, layers, value heads, key heads, head dim, intermediate, vocab)
SIZES = {
    "tiny": (64, 8, 32, 16, 4, 128, 320),
    "mid": (512, 12, 16, 8, 64, 1536, 32000),
}


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m specdec.evals.hybrid_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "mid"])
    p.add_argument("--runtimes", nargs="+", choices=["hf", "mlx"], default=["hf", "mlx"])
    p.add_argument("--steps", type=at_least(2), default=30)
    p.add_argument("--reject", type=at_least(1), default=4, help="drafts rolled back per verify of 8")
    p.add_argument("--out", help="write the figures here (JSON)")
    p.set_defaults(func=_run)
    return p


def build(size: str, out: Path) -> Path:
    """A random Qwen3.5 text model of `size` (seeded), saved as transformers saves it."""
    import torch
    import transformers

    h, n, hv, hk, d, inter, vocab = SIZES[size]
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        "qwen3_5_text", vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=n,
        num_attention_heads=max(h // 64, 4), num_key_value_heads=2, head_dim=64 if h >= 256 else 16,
        linear_num_value_heads=hv, linear_num_key_heads=hk, linear_key_head_dim=d, linear_value_head_dim=d,
        max_position_embeddings=4096,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def _held_bytes(v: Any) -> int:
    if v.runtime == "hf":
        n = sum(t.numel() * t.element_size() for la in v._linear for t in la.recurrent_states_history[0])
        n += sum(
            la.conv_states[0][..., : -la.conv_kernel_size[0]].numel() * la.conv_states[0].element_size()
            for la in v._linear
        )
        return n
    return sum(r.held_bytes() for r in v._recurrent.values())


def _sync(v: Any) -> None:
    if v.runtime == "mlx":
        import mlx.core as mx

        mx.eval([c.state for c in v._cache])


def measure(v: Any, *, steps: int, reject: int, plain: bool) -> dict[str, float]:
    """Median ms of verify / rollback over `steps` rounds (the first is a warm-up)."""
    import statistics

    prompt = [(37 * i + 11) % v.vocab_size for i in range(64)]
    block = [(13 * i + 5) % v.vocab_size for i in range(8)]
    saved = (v._linear, []) if v.runtime == "hf" else (v._recurrent, {})
    if plain:  # the machinery off: nothing recorded (and so nothing a rollback could undo)
        setattr(v, "_linear" if v.runtime == "hf" else "_recurrent", saved[1])
    v.reset()
    v.prefill(prompt)
    ver, rb, held = [], [], 0
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            v.verify(block)
            _sync(v)
            t1 = time.perf_counter()
            if not plain:
                held = _held_bytes(v)
                v.rollback(reject)
                _sync(v)
            else:  # keep the cache from growing: a plain rollback of the attention layers only
                v.reset()
                v.prefill(prompt)
            t2 = time.perf_counter()
            ver.append(t1 - t0)
            rb.append(t2 - t1)
    finally:
        setattr(v, "_linear" if v.runtime == "hf" else "_recurrent", saved[0])
        v.reset()
    out = {"verify_ms": 1e3 * statistics.median(ver[1:])}
    if not plain:
        out |= {"rollback_ms": 1e3 * statistics.median(rb[1:]), "held_bytes": held}
    return out


def _run(args: argparse.Namespace) -> int:
    from specdec.verifiers.hf import HFVerifier

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            path = build(size, Path(tmp) / size)
            for rt in args.runtimes:
                if rt == "hf":
                    v: Any = HFVerifier(path)
                else:
                    from specdec.verifiers.mlx import MLXVerifier

                    v = MLXVerifier(path)
                rec = measure(v, steps=args.steps, reject=args.reject, plain=False)
                base = measure(v, steps=args.steps, reject=args.reject, plain=True)
                extra = rec["verify_ms"] - base["verify_ms"] + rec["rollback_ms"]
                row = {"size": size, "runtime": rt, **rec, "plain_verify_ms": base["verify_ms"],
                       "machinery_share": extra / base["verify_ms"]}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"reject": args.reject, "rows": rows}, indent=1) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
