"""What an MTP draft costs next to a verify row, a DFlash block and a draft model's token, and what its
rollback adds to the hybrid state's: random Qwen3.5-shaped models with one MTP layer (`hybrid_cost`'s
sizes), the HF verifier, fp32, on this machine.

    python -m specdec.evals.mtp_cost --out docs/history/mtp-cost-2026-12-06.json

Per size, after a 64-token prompt, medians of `--reps` (each ending at a sync): `verify_ms[b]` a verify of
b tokens rolled back again; `mtp_ms[k]` a proposal of k MTP drafts (the rows its cache lacks, k - 1
chained rows); `dflash_block_ms` a random DFlash drafter's block of 8 (7 drafts, one forward);
`draft_model_token_ms` a one-token step of a draft model of the same shape (a real one is smaller);
`rollback_ms` the verifier's rollback of 4 positions alone and with the MTP cache's
(`rollback_with_mtp_ms`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.args import Parser, at_least, run_main
from specdec.evals.hybrid_cost import SIZES, build
from specdec.evals.report import median_ms


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m specdec.evals.mtp_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "mid"])
    p.add_argument("--reps", type=at_least(3), default=15)
    p.add_argument("--out", help="write the figures here (JSON)")
    p.set_defaults(func=_run)
    return p


def add_mtp_layers(path: Path, *, seed: int = 0) -> Path:
    """Give a Qwen3.5 / Qwen3-Next folder one MTP layer as the real checkpoints ship it: `mtp.fc`,
    `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` (the model's last
    full-attention layer's weights, perturbed) and `mtp.norm`; the config names it as the real ones do."""
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    f = path / "model.safetensors"
    sd = load_file(str(f))
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    full = max(i for i, t in enumerate(text["layer_types"]) if t == "full_attention")
    prefix = next(p for p in ("model.language_model.", "model.") if any(k.startswith(p) for k in sd))
    src, H = f"{prefix}layers.{full}.", text["hidden_size"]
    for k, v in list(sd.items()):
        if k.startswith(src):
            sd["mtp.layers.0." + k[len(src) :]] = (v + 0.02 * torch.randn(v.shape, generator=g)).contiguous()
    sd["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=g) * (2 * H) ** -0.5
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{n}.weight"] = 0.1 * torch.randn(H, generator=g)
    save_file(sd, str(f))
    text["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def _context(v: Any, d: Any, prompt: list[int]) -> int:
    import torch

    v.reset()
    v.set_target_layers(d.target_layer_ids)
    last = v.prefill(prompt)
    d.reset()
    n, cpu = len(prompt), torch.device("cpu")
    feats = v.features(n, device=cpu, dtype=d.dtype) if d.target_layer_ids else torch.empty(n, 0)
    d.extend(feats, prompt)
    return last


def measure(path: Path, reps: int) -> dict[str, Any]:
    from specdec.api import load_drafter
    from specdec.drafting.dflash.config import DFlashConfig
    from specdec.drafting.dflash.model import DFlashDraftModel
    from specdec.drafting.dflash.torch import DFlashDrafter
    from specdec.verifiers.hf import HFVerifier

    v = HFVerifier(path)
    prompt = [(37 * i + 11) % v.vocab_size for i in range(64)]
    mtp = load_drafter("mtp", verifier=v, block_size=8)
    out: dict[str, Any] = {"verify_ms": {}, "mtp_ms": {}}
    last = _context(v, mtp, prompt)
    for k in (1, 3, 7):
        out["mtp_ms"][k] = median_ms(lambda k=k: mtp.propose(last, k), reps)
    cfg = DFlashConfig(
        hidden_size=v.hidden_size, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=2 * v.hidden_size, vocab_size=v.vocab_size, num_target_layers=v.num_layers,
        mask_token_id=v.vocab_size - 1, block_size=8,
    )  # fmt: skip
    dflash = DFlashDrafter(DFlashDraftModel(cfg))
    dflash.bind(v)
    last = _context(v, dflash, prompt)
    out["dflash_block_ms"] = median_ms(lambda: dflash.propose(last, 7), reps)
    out["draft_model_token_ms"] = _draft_token(HFVerifier(path), prompt, last, reps)
    v.set_target_layers(mtp.target_layer_ids)
    last = _context(v, mtp, prompt)

    def verify(b: int, drafter: Any = None) -> None:
        v.verify([last] * b)
        v.rollback(b)
        if drafter is not None:
            drafter.rollback(0)

    for b in (1, 4, 8):
        out["verify_ms"][b] = median_ms(lambda b=b: verify(b), reps)
    rb = _rollbacks(v, mtp, last, reps)
    return out | rb


def _draft_token(draft: Any, prompt: list[int], last: int, reps: int) -> float:
    """A draft model's one-token step (the same shape as the verifier here: a real one is 10-50x smaller),
    its rollback untimed."""
    draft.set_target_layers(())
    draft.reset()
    draft.prefill(prompt)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        draft.verify([last])
        times.append((time.perf_counter() - t0) * 1e3)
        draft.rollback(1)
    return round(statistics.median(times[1:]), 3)


def _rollbacks(v: Any, mtp: Any, last: int, reps: int) -> dict[str, float]:
    """The verifier's rollback of 4 of a verify of 8, alone and with the MTP drafter's of the same 4."""
    import torch

    def step(with_mtp: bool) -> float:
        v.verify([last] * 8)
        feats = v.features(8, device=torch.device("cpu"), dtype=mtp.dtype)
        mtp.extend(feats, [last] * 8)
        mtp.propose(last, 3)  # its cache holds rows of the 8 now
        t0 = time.perf_counter()
        v.rollback(4)
        if with_mtp:
            mtp.rollback(4)
        dt = (time.perf_counter() - t0) * 1e3
        if not with_mtp:
            mtp.rollback(4)
        return dt  # the context grows by 4 a step: a hybrid state cannot go back past its last verify

    alone = [step(False) for _ in range(reps)]
    both = [step(True) for _ in range(reps)]
    return {"rollback_ms": round(statistics.median(alone), 3),
            "rollback_with_mtp_ms": round(statistics.median(both), 3)}  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    from specdec.evals.report import emit_figures, figures_header

    result: dict[str, Any] = {**figures_header("specdec.evals.mtp_cost"), "sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            path = add_mtp_layers(build(size, Path(tmp) / size))
            result["sizes"][size] = measure(path, args.reps)
    emit_figures(result, args.out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
