"""What an EAGLE-3 draft step costs next to a verify row and a DFlash block, and that specdec's EAGLE-3
drafts equal mlx-vlm's over a whole generation: SmolLM2-135M, a random SmolLM2-shaped EAGLE-3 drafter
(one layer, a 32000-token draft vocabulary as the public Llama-3 drafters have; speculators dialect).

    python -m specdec.evals.eagle3_cost --out docs/history/eagle3_cost.json

`cost` (HF verifier and torch drafters, `--dtype`, after a `--context`-token prompt, medians of
`--reps`, each ending at a sync): `verify_ms[b]` a verify of b tokens rolled back again; `eagle3_ms[k]`
a proposal of k EAGLE-3 drafts (the rows the cache lacks, k chained draft rows, the one sync); the
DFlash block of the bundled drafter (`dflash_block_ms`, whole block, the one sync). `peer` (MLX verifier,
fp32, the MLX drafter and mlx-vlm 0.7.10's drafter fed the same hidden states and the same commits): a
greedy generation of `--tokens` tokens by specdec's engine, each step's drafts compared with the peer's
and the acceptance the peer's drafts would have had.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.args import Parser, at_least, run_main
from specdec.evals.report import median_ms

MODEL = "smollm2-135m"


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m specdec.evals.eagle3_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", choices=["cost", "peer"], default=["cost", "peer"])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="of the cost part")
    p.add_argument("--context", type=at_least(8), default=300)
    p.add_argument("--reps", type=at_least(3), default=15)
    p.add_argument("--tokens", type=at_least(8), default=96, help="generated in the peer part")
    p.add_argument("--out", help="write the figures here (JSON)")
    p.set_defaults(func=_run)
    return p


def random_drafter(folder: Path, target: Any) -> Path:
    """A random EAGLE-3 checkpoint shaped for `target` (seeded; its LM head scaled so drafts vary)."""
    import torch

    from specdec.drafting.eagle3.config import Eagle3Config, save_eagle3
    from specdec.drafting.eagle3.torch import Eagle3Model

    H, heads = target.hidden_size, target.model.config.num_attention_heads
    cfg = Eagle3Config(
        dialect="speculators", hidden_size=H, intermediate_size=target.model.config.intermediate_size,
        num_layers=1, num_attention_heads=heads, num_key_value_heads=target.model.config.num_key_value_heads,
        head_dim=H // heads, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None, attention_bias=False,
        qk_norm=False, vocab_size=target.vocab_size, draft_vocab_size=min(32000, target.vocab_size),
        target_hidden_size=H, aux_layer_ids=None, block_size=8, target_model=MODEL,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Eagle3Model(cfg)
    state = {k: v for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    state["lm_head.weight"] = state["lm_head.weight"] * 20
    if cfg.draft_vocab_size != cfg.vocab_size:
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)  # the first K ids
    return save_eagle3(folder, cfg, state)


def cost(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch

    from specdec.api import load_drafter, load_verifier

    v = load_verifier("hf", MODEL, dtype=args.dtype)
    folder = random_drafter(tmp / "eagle3", v)
    e3 = load_drafter(str(folder), verifier=v, dtype=args.dtype, block_size=8)
    dflash = load_drafter(f"bundled:{MODEL}", verifier=v, dtype=args.dtype)
    prompt = [(13 * i) % 5000 + 100 for i in range(args.context)]
    out: dict[str, Any] = {"verify_ms": {}, "eagle3_ms": {}}
    for d in (e3, dflash):  # each drafter's context: the prompt's features
        v.reset()
        v.set_target_layers(d.target_layer_ids)
        last = v.prefill(prompt)
        d.reset()
        d.extend(v.features(len(prompt), device=torch.device("cpu"), dtype=d.dtype), prompt)
        if d is e3:
            for k in (1, 2, 4, 7):
                out["eagle3_ms"][k] = median_ms(lambda d=d, k=k, t=last: d.propose(t, k), args.reps)
        else:
            out["dflash_block_ms"] = median_ms(lambda d=d, t=last: d.propose(t, d.block_size - 1), args.reps)
            out["dflash_block_size"] = d.block_size
    v.set_target_layers(())

    def verify(b: int) -> None:
        v.verify([last] * b)
        v.rollback(b)

    for b in (1, 2, 4, 8):
        out["verify_ms"][b] = median_ms(lambda b=b: verify(b), args.reps)
    e = out["eagle3_ms"]
    out["eagle3_step_ms"] = round((e[7] - e[1]) / 6, 3)  # each chained draft row past the first
    return out


def peer(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config as VlmConfig
    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

    from specdec.api import load_drafter, load_verifier
    from specdec.engine import DecodeConfig, decode

    v = load_verifier("mlx", MODEL, dtype="float32")
    hf_shape = load_verifier("hf", MODEL, dtype="float32")  # its config, for the drafter's shape
    folder = random_drafter(tmp / "eagle3-peer", hf_shape)
    d = load_drafter(str(folder), verifier=v, runtime="mlx", block_size=6)
    p = Eagle3DraftModel(VlmConfig.from_dict(json.loads((folder / "config.json").read_text())))
    p.load_weights(list(p.sanitize(mx.load(str(folder / "model.safetensors"))).items()), strict=False)
    p.bind(v.model)  # its loader would drop the embeddings: built and bound by hand
    prompt = v.tokenizer.encode("def fibonacci(n):\n    ")
    cfg = DecodeConfig(max_new_tokens=args.tokens, block_size=6, stop_token_ids=frozenset())
    # the peer's drafts are computed from the same hidden states and commits the engine's drafter sees
    both = _Recorder(d, p, v.model)
    steps = [s for s in decode(v, prompt, drafter=both, cfg=cfg) if s.phase == "decode"]
    same = sum(r["ours"] == r["peer"] for r in both.log)
    return {
        "tokens": sum(len(s.tokens) for s in steps), "steps": len(steps), "proposals": len(both.log),
        "drafts_equal": same, "acceptance": [s.acceptance_length for s in steps],
    }  # fmt: skip


class _Recorder:
    """Our MLX drafter, with mlx-vlm's drafter advanced beside it on the same features and commits."""

    def __init__(self, d: Any, p: Any, target: Any) -> None:
        self.d, self.p, self.target, self.started = d, p, target, False
        self.log: list[dict[str, list[int]]] = []
        self._feats: list[Any] = []
        self._toks: list[int] = []
        self._drafts: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.d, name)

    def extend(self, features: Any, tokens: Sequence[int]) -> None:
        self.d.extend(features, tokens)
        self._feats.append(features)
        self._toks += tokens

    def propose(self, last: int, n: int) -> list[int]:
        import mlx.core as mx

        feats = mx.concatenate(self._feats)[None]
        if not self.started:
            self.p.reset(self.target)
            self.p.prefill_from_target_hidden(mx.array([self._toks]), feats, last, None, greedy=True)
            self.started = True
        else:
            a = len(self._feats[-1]) - 1 if len(self._feats) > 1 else 0
            hid = feats[:, -len(self._feats[-1]) :]  # [1, a + 1, 3H]: the features of the commits
            self.p.accept_verified_tokens(hid, mx.array([self._drafts]), a, [last], None, greedy=True)
        peer = self.p.draft_block(last, None, None, n + 1, None, greedy=True)[0].tolist()
        ours = self.d.propose(last, n)
        self._drafts = peer
        self.log.append({"ours": ours, "peer": peer})
        return ours


def _run(args: argparse.Namespace) -> int:
    from importlib import metadata

    import torch

    from specdec.evals.report import emit_figures, figures_header

    result: dict[str, Any] = {
        **figures_header("specdec.evals.eagle3_cost"), "model": MODEL,
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "mlx_vlm": metadata.version("mlx-vlm") if "peer" in args.parts else None,
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        if "cost" in args.parts:
            result["cost"] = {"dtype": args.dtype, "context": args.context, **cost(args, Path(tmp))}
        if "peer" in args.parts:
            result["peer"] = peer(args, Path(tmp))
    emit_figures(result, args.out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
