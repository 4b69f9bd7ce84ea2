"""What a Gemma-4 assistant's draft costs next to a verify row, and what handing it the verifier's K/V
costs: random Gemma 4 targets (dense, E2B-like: sliding and full layers, the last ones KV-shared) with
random assistants of the released layout, on the HF and MLX verifiers, fp32, on this machine.

    python -m specdec.evals.assistant_cost --out docs/history/assistant-cost-2026-12-06.json

Per size and runtime, after a prompt of `--context` tokens (past the sliding window), medians of `--reps`
(each ending at a sync): `verify_ms[b]` a verify of b tokens rolled back again; `assistant_ms[k]` a
proposal of k drafts (the K/V hand-over, the final norm of the last hidden state, k passes through the
assistant); `per_draft_ms` the slope (k = 7 against k = 1); `handover_ms` the hand-over alone (the views
or slices of the two layers' K/V, made and evaluated); `copy_kv_ms` what copying those two layers' K/V
would cost instead, each step.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.args import Parser, at_least, run_main
from specdec.evals.report import median_ms

#: target (hidden, layers, heads, head_dim, global_head_dim, intermediate, vocab, window, every how many
#: layers a full one), assistant
#: (hidden, layers, intermediate): "mid" is E2B's per-layer shape (hidden 1536, head_dim 256 / 512, one
#: K/V head, window 512) on 12 layers and a 32k vocabulary; the assistant's sizes are ours, not Google's
SIZES = {
    "tiny": ((64, 6, 4, 16, 32, 128, 320, 8, 3), (32, 2, 64)),
    "mid": ((1536, 12, 8, 256, 512, 6144, 32000, 512, 6), (256, 4, 2048)),
}


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m specdec.evals.assistant_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "mid"])
    p.add_argument("--runtimes", nargs="+", choices=["hf", "mlx"], default=["hf", "mlx"])
    p.add_argument("--context", type=at_least(16), default=600)
    p.add_argument("--reps", type=at_least(3), default=15)
    p.add_argument("--out", help="write the figures here (JSON)")
    p.set_defaults(func=_run)
    return p


def build(size: str, root: Path) -> tuple[Path, Path]:
    """A random Gemma 4 target of `size` and a random assistant for it (seeded), saved as transformers
    saves them: (target folder, assistant folder)."""
    import torch
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4ForCausalLM,
        Gemma4TextConfig,
    )

    (h, n, heads, d, gd, inter, vocab, w, period), (ah, an, ainter) = SIZES[size]
    torch.manual_seed(0)
    types = (["sliding_attention"] * (period - 1) + ["full_attention"]) * (n // period)
    common = dict(num_key_value_heads=1, head_dim=d, global_head_dim=gd, sliding_window=w, vocab_size=vocab,
                  max_position_embeddings=4096, final_logit_softcapping=30.0)  # fmt: skip
    target = Gemma4TextConfig(
        hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, intermediate_size=inter,
        layer_types=types, hidden_size_per_layer_input=0, num_kv_shared_layers=n // 3, **common,
    )  # fmt: skip
    Gemma4ForCausalLM(target).eval().save_pretrained(root / "target")
    text = Gemma4TextConfig(
        hidden_size=ah, num_hidden_layers=an, num_attention_heads=heads, intermediate_size=ainter,
        layer_types=["sliding_attention"] * (an - 1) + ["full_attention"], hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, num_kv_shared_layers=an, use_double_wide_mlp=False, **common,
    )  # fmt: skip
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=h, use_ordered_embeddings=False)
    Gemma4AssistantForCausalLM(cfg).eval().save_pretrained(root / "assistant")
    return root / "target", root / "assistant"


def measure(target: Path, assistant: Path, runtime: str, context: int, reps: int) -> dict[str, Any]:
    """The figures of one target / assistant pair on one runtime (module docstring)."""
    from specdec.api import load_drafter

    if runtime == "mlx":
        from specdec.verifiers.mlx import MLXVerifier

        v: Any = MLXVerifier(target)
    else:
        from specdec.verifiers.hf import HFVerifier

        v = HFVerifier(target)
    d = load_drafter(str(assistant), verifier=v, runtime="mlx" if runtime == "mlx" else "torch", block_size=8)
    prompt = [(37 * i + 11) % v.vocab_size for i in range(context)]
    v.set_target_layers(d.target_layer_ids)
    last = v.prefill(prompt)
    feats = (
        v.native_features(context)
        if runtime == "mlx"
        else v.features(context, device=d.device, dtype=d.dtype)
    )
    d.extend(feats, prompt)
    v.verify([last] * 8)
    v.rollback(8)  # the sliding layers cropped as after a decode step
    out: dict[str, Any] = {"context": context, "verify_ms": {}, "assistant_ms": {}}
    for b in (1, 4, 8):
        out["verify_ms"][b] = median_ms(lambda b=b: (v.verify([last] * b), v.rollback(b)), reps)
    for k in (1, 3, 7):
        out["assistant_ms"][k] = median_ms(lambda k=k: d.propose(last, k), reps)
    out["per_draft_ms"] = round((out["assistant_ms"][7] - out["assistant_ms"][1]) / 6, 3)
    out["handover_ms"], out["copy_kv_ms"] = _handover(v, d, runtime, reps)
    return out


def _handover(v: Any, d: Any, runtime: str, reps: int) -> tuple[float, float]:
    """The K/V hand-over of one step (made and evaluated), and a copy of the same two layers' K/V."""
    from specdec.drafting.gemma4_assistant.config import kv_window

    def views() -> list[Any]:
        return [x for t, layer in d._sources.items() for x in v.shared_kv(layer, last=kv_window(d.cfg, t))]

    full = [x for layer in d._sources.values() for x in v.shared_kv(layer)]
    if runtime == "mlx":
        import mlx.core as mx

        return median_ms(lambda: mx.eval(*views()), reps), median_ms(
            lambda: mx.eval(*[x + 0 for x in full]), reps
        )
    return median_ms(views, reps), median_ms(lambda: [x.clone() for x in full], reps)


def _run(args: argparse.Namespace) -> int:
    from specdec.evals.report import emit_figures, figures_header

    result: dict[str, Any] = {**figures_header("specdec.evals.assistant_cost"), "sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            target, assistant = build(size, Path(tmp) / size)
            result["sizes"][size] = {
                rt: measure(target, assistant, rt, args.context, args.reps) for rt in args.runtimes
            }
    emit_figures(result, args.out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
