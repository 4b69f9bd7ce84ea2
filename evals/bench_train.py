"""Training-step benchmark of the DFlash drafter: forward + backward time and peak memory per attn_chunk.

python -m specdec.evals.bench_train                  # CPU-sized default (full preset when CUDA is present)
python -m specdec.evals.bench_train --preset full    # H=5120, 5 target layers, 5 draft layers, block 32,
                                                     # 1024 anchors, 8000 positions, bf16
Random weights, features and tokens: it measures the step of `specdec.train.block_loss` (the one `train`
runs: block-sparse forward chunk by chunk, loss inside each chunk, backward), not learning. One warm-up,
then `--iters` timed iterations, synchronised on CUDA. Peak memory from `specdec.memory.probe_for_device`
(CUDA allocator peak; on Linux CPU the process high-water mark, which includes everything the process ever
held since the reset). An out-of-memory configuration is recorded as such instead of aborting the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.drafting.dflash.config import DFlashConfig
from specdec.drafting.dflash.torch import DFlashDraftModel
from specdec.memory import probe_for_device
from specdec.records import format_bytes
from specdec.train import Batch, block_loss, default_gamma, sample_anchors


@dataclass(frozen=True, kw_only=True)
class BenchShape:
    hidden_size: int
    num_target_layers: int  # K: target layers whose features are concatenated
    num_draft_layers: int
    block_size: int
    max_anchors: int
    seq_len: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    dtype: str  # compute dtype (bfloat16 = autocast over fp32 master weights, as train() does)


PRESETS = {
    "cpu": BenchShape(
        hidden_size=128, num_target_layers=3, num_draft_layers=2, block_size=16, max_anchors=32, seq_len=512,
        vocab_size=4096, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=384,
        dtype="float32",
    ),
    # Qwen3-14B-sized target (hidden 5120, vocab 151936), the public drafter shape (5 layers, 40/8 heads)
    "full": BenchShape(
        hidden_size=5120, num_target_layers=5, num_draft_layers=5, block_size=32, max_anchors=1024,
        seq_len=8000, vocab_size=151936, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        intermediate_size=17408, dtype="bfloat16",
    ),
}  # fmt: skip
DEFAULT_CHUNKS = {"cpu": [None, 16, 8, 4], "full": [None, 256, 128, 64]}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def bench(
    shape: BenchShape, chunks: list[int | None], *, device: str, iters: int = 5, seed: int = 0
) -> list[dict[str, Any]]:
    """One row per attn_chunk: mean / min step seconds, tokens/s, peak memory record."""
    dev = torch.device(device)
    torch.manual_seed(seed)
    H, V, K, T = shape.hidden_size, shape.vocab_size, shape.num_target_layers, shape.seq_len
    cfg = DFlashConfig(
        hidden_size=H, num_hidden_layers=shape.num_draft_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size, vocab_size=V, num_target_layers=max(K + 3, 8),
        mask_token_id=V - 1, block_size=shape.block_size, target_layer_ids=tuple(range(1, K + 1)),
    )  # fmt: skip
    model = DFlashDraftModel(cfg).to(dev).train()
    emb = torch.randn(V, H, device=dev) * 0.02  # frozen, fp32 like train()'s callbacks
    head = torch.randn(V, H, device=dev) * H**-0.5

    def embed_fn(ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, emb)

    def lm_head_fn(h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, head)

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (1, T), generator=g)
    anchors = sample_anchors(1, T, shape.block_size, shape.max_anchors, seed)[None]  # [1, A]
    batch = Batch(
        ids=ids.to(dev),
        features=(torch.randn(1, T, K * H, generator=g) * 0.5).to(device=dev, dtype=torch.bfloat16),
        anchors=anchors.to(dev),
        valid=torch.ones_like(anchors, dtype=torch.bool).to(dev),
    )
    n_tok = anchors.shape[1] * (shape.block_size - 1)
    gamma = default_gamma(shape.block_size)
    probe = probe_for_device(dev)
    autocast = shape.dtype == "bfloat16"

    def step(chunk: int | None) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            r = block_loss(model, batch, embed_fn, lm_head_fn, gamma=gamma, attn_chunk=chunk)
        (r["loss_sum"] / r["weight_sum"]).backward()
        _sync(dev)
        dt = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return dt

    rows = []
    for chunk in chunks:
        row: dict[str, Any] = {"attn_chunk": chunk, "anchors": int(anchors.shape[1]), "tokens": n_tok}
        try:
            step(chunk)  # warm-up
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            probe.reset()
            times = [step(chunk) for _ in range(iters)]
            row.update(
                status="ok", step_s_mean=sum(times) / len(times), step_s_min=min(times),
                tokens_per_s=n_tok / (sum(times) / len(times)), peak_memory=probe.read(),
            )  # fmt: skip
        except (RuntimeError, torch.OutOfMemoryError) as e:
            if not _is_oom(e):
                raise
            model.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            row.update(status="oom", error=str(e).splitlines()[0][:200])
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| attn_chunk | anchors | step s (mean) | step s (min) | tokens/s | peak memory |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        chunk = "all" if r["attn_chunk"] is None else str(r["attn_chunk"])
        if r["status"] != "ok":
            lines.append(f"| {chunk} | {r['anchors']} | {r['status']} | | | |")
            continue
        lines.append(
            f"| {chunk} | {r['anchors']} | {r['step_s_mean']:.3f} | {r['step_s_min']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {format_bytes(r['peak_memory'])} |"
        )
    return "\n".join(lines)


def _chunk(s: str) -> int | None:
    return None if s in ("none", "all", "0") else int(s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specdec.evals.bench_train", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--preset", choices=("auto", *PRESETS), default="auto", help="auto: full on CUDA, else cpu"
    )
    p.add_argument("--device", help="default: cuda when available, else cpu")
    for f in BenchShape.__dataclass_fields__:
        kind = str if f == "dtype" else int
        p.add_argument("--" + f.replace("_", "-"), type=kind, help="override the preset")
    p.add_argument("--attn-chunks", type=lambda s: [_chunk(x) for x in s.split(",")], help="e.g. all,64,16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", default="bench_train.json", help="JSON output path")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = args.preset if args.preset != "auto" else ("full" if device.startswith("cuda") else "cpu")
    shape = replace(
        PRESETS[preset], **{f: getattr(args, f) for f in BenchShape.__dataclass_fields__ if getattr(args, f)}
    )
    if shape.dtype not in ("float32", "bfloat16"):
        raise SystemExit(f"error: --dtype must be float32 or bfloat16, got {shape.dtype!r}")
    if args.iters < 1:
        raise SystemExit(f"error: --iters must be >= 1, got {args.iters}")
    if shape.seq_len < shape.block_size + 1:
        raise SystemExit(
            f"error: --seq-len {shape.seq_len} leaves no anchor for block size {shape.block_size}"
        )
    chunks = args.attn_chunks or DEFAULT_CHUNKS[preset]
    print(f"preset {preset} on {device}: {json.dumps(asdict(shape))}", file=sys.stderr)
    rows = bench(shape, chunks, device=device, iters=args.iters, seed=args.seed)
    from specdec.records import atomic_write_json, environment

    n_anchor = min(shape.max_anchors, shape.seq_len - shape.block_size + 1)
    result = {
        "benchmark": "drafter_train_step", "preset": preset, "shape": asdict(shape), "iters": args.iters,
        "anchors": n_anchor, "rows": rows, "environment": environment(device),
    }  # fmt: skip
    atomic_write_json(Path(args.out), result)
    print(table(rows))
    print(f"json: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
