"""Drafter training: build a dataset with a verifier, then train a DFlash drafter on it (also under torchrun).

Two stages, each resumable.

1. `build_dataset(verifier, prompts, out_dir)`. The verifier writes its own response to every prompt
   (greedy, or sampled at a temperature): an HF verifier through `model.generate`, batched with left
   padding; any other verifier through the engine's autoregressive loop (block size 1, its sampler at
   T > 0), one prompt at a time. Chat messages go through the tokenizer's chat template where it has one
   (otherwise their contents are joined with newlines and encoded as text). One teacher-forced pass over
   prompt+response then captures the target features (`reset`, `set_target_layers`, `prefill`,
   `features`). Stored per sequence: int32 token ids [T] and bf16 features [T, K*H] (with `kl_topk` also
   the verifier's top-k log-probs of the next token at every position, read in the same pass through
   `verify`'s sample callback), in shards `shard-NNNNN.pt` (torch.save, read back memory-mapped) listed in
   `index.json` (settings, one row per sequence, skipped prompts). A second call skips every prompt
   already in the index; changed settings raise. The frozen embedding (scale baked in) and LM head
   (weight, bias, soft-cap) are saved once as `heads.safetensors`, so training needs no verifier.

2. `train(verifier_or_none, dataset_dir, cfg)`. Anchors are drawn per sequence (at most `max_anchors`)
   only where the whole block of labels lies in the response: anchor a needs prompt_len - 1 <= a <= T - bs
   (an anchor on the last prompt token is fine: it is the bonus token a real first step starts from).
   Every anchor's block `[x_a, MASK...]` sees the features of positions < a and its own block
   (block-sparse mask). Loss: cross-entropy on block positions k = 1..bs-1 weighted by exp(-(k-1)/gamma),
   normalised by the weight sum of the global batch; the anchor position is not supervised. With
   `kl_weight` > 0 the loss adds KL(p || q): p is the verifier's distribution of the token at a+k (its
   logits at a+k-1, cached at build time as top-k log-probs, renormalised over the top k), q the
   drafter's. Anchor blocks run `attn_chunk` at a time, each chunk under activation checkpointing with its
   loss computed inside, so neither attention nor logits of all anchors coexist, forward or backward.
   Embedding and LM head are frozen callbacks: only drafter parameters train. AdamW, warmup + cosine,
   grad clip, public-format checkpoints (`checkpoint-NNNNNN/`: config.json + model.safetensors, plus the
   optimizer / scheduler / step in `trainer_state.pt`), resume from the latest one, `train_log.jsonl`.
   Held-out evaluation: teacher-forced top-1 accuracy and expected acceptance length (1 + the leading run
   of correct positions per anchor) on held-out sequences and, with a verifier, the real mean acceptance
   length of `specdec.engine.generate` with the drafter on the held-out prompts.

Data parallel: under torchrun (env RANK / WORLD_SIZE) each rank takes a slice of the global batch (gloo on
CPU, nccl on CUDA) and gradients are summed by all-reduce; the loss is normalised by the global weight sum,
so 1 process and N processes take the same steps. Batches and anchors come from generators seeded by
(seed, epoch) and (seed, step, sequence): runs are deterministic and a resumed run continues exactly as an
uninterrupted one.

Shards are memory-mapped, but each batch holds whole sequences of features: right for the small targets
this project trains on; a multi-billion-parameter target would want features computed online instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.chat import encode_prompt
from specdec.checkpoint import (
    DFlashConfig,
    default_target_layer_ids,
    load_checkpoint,
    load_config,
    save_checkpoint,
)
from specdec.protocols import EmbedFn, LMHeadFn, Verifier

__all__ = [
    "Batch",
    "TrainConfig",
    "TrainData",
    "acceptance_length",
    "add_train_args",
    "block_loss",
    "build_dataset",
    "cmd_train",
    "default_gamma",
    "drafter_config",
    "extract_heads",
    "load_heads",
    "load_prompts",
    "sample_anchors",
    "train",
]

DATA_FORMAT = "specdec-train-data"
DATA_VERSION = 1
INDEX_NAME = "index.json"
HEADS_NAME = "heads.safetensors"
STATE_NAME = "trainer_state.pt"
LOG_NAME = "train_log.jsonl"


# ----------------------------------------------------------------------------------------------------------
# prompts


def load_prompts(path: str | os.PathLike[str]) -> list[tuple[str, str | list[dict[str, str]]]]:
    """(id, prompt) pairs from a JSONL of {"id"?, "messages"} or {"id"?, "text"} records, or from plain
    text (one prompt per non-empty line). Ids default to the line number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    out: list[tuple[str, str | list[dict[str, str]]]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    jsonl = path.suffix == ".jsonl" or (bool(lines) and lines[0].lstrip().startswith("{"))
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        if not jsonl:
            out.append((str(n), line))
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n + 1}: not valid JSON ({e})") from e
        pid = str(rec.get("id", n))
        if "messages" in rec:
            out.append((pid, list(rec["messages"])))
        elif "text" in rec:
            out.append((pid, str(rec["text"])))
        else:
            raise ValueError(f"{path}:{n + 1}: a record needs 'messages' or 'text' (found {sorted(rec)})")
    return out


def _normalise_prompts(prompts: Any) -> list[tuple[str, Any]]:
    if isinstance(prompts, (str, os.PathLike)):
        items = load_prompts(prompts)
    else:
        items = []
        for i, p in enumerate(prompts):
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
                items.append(p)
            elif isinstance(p, dict) and ("messages" in p or "text" in p):
                items.append((str(p.get("id", i)), p.get("messages", p.get("text"))))
            else:
                items.append((str(i), p))
    ids = [pid for pid, _ in items]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"duplicate prompt ids {dup[:5]}: ids must be unique for the dataset cache")
    return items


# ----------------------------------------------------------------------------------------------------------
# response generation


def _cut(tokens: Sequence[int], stops: frozenset[int], budget: int) -> list[int]:
    """The first `budget` tokens, up to and including the first stop token."""
    out = []
    for t in tokens[:budget]:
        out.append(int(t))
        if t in stops:
            break
    return out


def _is_hf(verifier: Verifier) -> bool:
    return getattr(verifier, "runtime", None) == "hf" and hasattr(
        getattr(verifier, "model", None), "generate"
    )


def _generate_hf(
    verifier: Any, prompts: list[list[int]], budgets: list[int], *, temperature: float, seed: int
) -> list[list[int]]:
    """One `model.generate` call over a batch of prompts (left padding + attention mask)."""
    model = verifier.model
    dev = next(model.parameters()).device
    stops = frozenset(verifier.eos_token_ids)
    tok = verifier.tokenizer
    pad = getattr(tok, "pad_token_id", None) if tok is not None else None
    if pad is None:
        pad = min(stops) if stops else 0
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (L - len(p)) + list(p) for p in prompts], dtype=torch.long, device=dev)
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=dev)
    kw: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        torch.manual_seed(seed)
        kw = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max(budgets), pad_token_id=pad,
            eos_token_id=sorted(stops) or None, **kw,
        )  # fmt: skip
    return [_cut(row[L:].tolist(), stops, b) for row, b in zip(out, budgets)]


def _generate_one(
    verifier: Verifier, prompt: list[int], budget: int, *, temperature: float, seed: int
) -> list[int]:
    """The engine's autoregressive loop (block size 1), greedy or sampled with `seed`."""
    from specdec.engine import DecodeConfig, generate
    from specdec.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature, seed=seed) if temperature > 0 else None
    res = generate(verifier, prompt, cfg=DecodeConfig(max_new_tokens=budget, block_size=1, sampling=sampling))
    return list(res.output_tokens)


def _teacher_forced(
    verifier: Verifier, seq: list[int], layer_ids: tuple[int, ...], kl_topk: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Features [T, K*H] (bf16) of one pass over `seq` and, with kl_topk, the verifier's top-k log-probs
    [T, k] (bf16) and ids [T, k] (int32) of the token after each position (read through `verify`'s
    sample callback, which sees the logits of every position)."""
    verifier.set_target_layers(layer_ids)
    verifier.reset()
    top = None
    if kl_topk:
        seen: list[torch.Tensor] = []

        def capture(logits: torch.Tensor) -> list[int]:  # [T, V]
            seen.append(torch.log_softmax(logits.float(), -1).topk(kl_topk, dim=-1))
            return logits.argmax(-1).tolist()

        verifier.verify(seq, sample=capture)
        top = seen[0]
    else:
        verifier.prefill(seq)
    feats = verifier.features(len(seq), device=torch.device("cpu"), dtype=torch.bfloat16)  # [T, K*H]
    verifier.set_target_layers(())
    if top is None:
        return feats, None, None
    return feats, top.values.to("cpu", torch.bfloat16), top.indices.to("cpu", torch.int32)


# ----------------------------------------------------------------------------------------------------------
# the frozen embedding / LM head, read out of the callbacks


def _softcap_from_config(verifier: Verifier) -> float | None:
    cfg = getattr(verifier, "config", None)
    if isinstance(cfg, dict):
        cap = cfg.get("final_logit_softcapping")
    else:
        cap = getattr(cfg, "final_logit_softcapping", None)
    return float(cap) if cap else None


@torch.no_grad()
def extract_heads(verifier: Verifier) -> tuple[dict[str, torch.Tensor], float | None]:
    """The embedding table (scale included) and the LM head weight / bias exactly as the verifier's
    callbacks compute them (probed in fp32), and the soft-cap. Raises if the head is not linear (+ cap)."""
    dev, f32 = torch.device("cpu"), torch.float32
    V, H = verifier.vocab_size, verifier.hidden_size
    embed = verifier.embed_fn(device=dev, dtype=f32)
    head = verifier.lm_head_fn(device=dev, dtype=f32)
    table = torch.cat([embed(torch.arange(i, min(i + 4096, V))).float() for i in range(0, V, 4096)])  # [V, H]

    def probe(cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        eye = torch.cat([torch.zeros(1, H), torch.eye(H)])  # [H+1, H]: 0, then each unit vector
        y = torch.cat([head(eye[i : i + 256]).float() for i in range(0, H + 1, 256)])  # [H+1, V]
        if cap:
            y = torch.atanh((y / cap).clamp(-1 + 1e-7, 1 - 1e-7)) * cap
        return (y[1:] - y[:1]).T.contiguous(), y[0].clone()  # weight [V, H], bias [V]

    x = torch.randn(4, H, generator=torch.Generator().manual_seed(0))
    want = head(x).float()
    for cap in dict.fromkeys([_softcap_from_config(verifier), None]):
        w, b = probe(cap)
        got = x @ w.T + b
        got = torch.tanh(got / cap) * cap if cap else got
        if torch.allclose(got, want, atol=1e-3, rtol=1e-3):
            out = {"embed": table, "lm_head": w}
            if b.abs().max() > 0:
                out["lm_head_bias"] = b
            return out, cap
    raise ValueError(
        f"cannot read the LM head of {verifier.model_name!r} as a linear map (plus a soft-cap): pass the "
        "verifier to train() instead of relying on the dataset's saved heads"
    )


def load_heads(
    dataset_dir: str | os.PathLike[str],
    *,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    rows: torch.Tensor | None = None,
) -> tuple[EmbedFn, LMHeadFn]:
    """embed_fn / lm_head_fn from a dataset's `heads.safetensors` (the head over `rows` only if given)."""
    from safetensors import safe_open

    path = Path(dataset_dir) / HEADS_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is missing: rebuild the dataset or pass the verifier to train()"
        )
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        t = {k: f.get_tensor(k).to(device=device, dtype=dtype) for k in f.keys()}  # noqa: SIM118
    emb, w, b = t["embed"], t["lm_head"], t.get("lm_head_bias")
    if rows is not None:
        rows = rows.to(device)
        w, b = w[rows], None if b is None else b[rows]  # [K, H], [K]
    cap = float(meta["softcap"]) if meta.get("softcap", "none") != "none" else None

    def embed_fn(ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, emb)

    def lm_head_fn(h: torch.Tensor) -> torch.Tensor:
        y = F.linear(h, w, b)
        return torch.tanh(y / cap) * cap if cap else y

    return embed_fn, lm_head_fn


# ----------------------------------------------------------------------------------------------------------
# dataset


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_index(out_dir: Path) -> dict[str, Any] | None:
    p = out_dir / INDEX_NAME
    return json.loads(p.read_text()) if p.is_file() else None


def default_data_layer_ids(num_layers: int) -> tuple[int, ...]:
    """min(5, L-3) layers evenly spaced from 1 to L-3 (the public default); L//2 for tiny targets."""
    return default_target_layer_ids(num_layers, max(1, min(5, num_layers - 3)))


def build_dataset(
    verifier: Verifier,
    prompts: str | os.PathLike[str] | Iterable[Any],
    out_dir: str | os.PathLike[str],
    *,
    target_layer_ids: Sequence[int] | None = None,
    max_new_tokens: int = 512,
    max_seq_len: int = 3072,
    temperature: float = 0.0,
    batch_size: int = 8,
    kl_topk: int = 0,
    shard_size: int = 64,
    seed: int = 0,
    max_prompts: int | None = None,
    progress: bool = True,
) -> Path:
    """Regenerate responses with `verifier`, capture teacher-forced features, cache them in `out_dir`.

    `prompts`: a file (see `load_prompts`) or a list of text / chat messages / token ids / (id, prompt)
    pairs. `target_layer_ids` None: `default_data_layer_ids`. `max_seq_len` bounds prompt + response
    (longer prompts are skipped and recorded). `batch_size` is the `model.generate` batch of an HF
    verifier. `kl_topk` > 0 also caches the verifier's top-k next-token log-probs (for
    `TrainConfig.kl_weight`). Resumable: prompts already in the index are skipped.
    """
    problems = []
    if max_new_tokens < 1:
        problems.append(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_seq_len < 2:
        problems.append(f"max_seq_len must be >= 2, got {max_seq_len}")
    if temperature < 0:
        problems.append(f"temperature must be >= 0, got {temperature}")
    if batch_size < 1 or shard_size < 1:
        problems.append(f"batch_size and shard_size must be >= 1, got {batch_size}, {shard_size}")
    if not 0 <= kl_topk <= verifier.vocab_size:
        problems.append(f"kl_topk must be in 0..{verifier.vocab_size}, got {kl_topk}")
    ids = tuple(int(i) for i in (target_layer_ids or default_data_layer_ids(verifier.num_layers)))
    bad = [i for i in ids if not 0 <= i < verifier.num_layers]
    if bad or not ids:
        problems.append(f"target_layer_ids {list(ids)} must be non-empty within 0..{verifier.num_layers - 1}")
    if problems:
        raise ValueError("invalid dataset settings: " + "; ".join(problems))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "verifier": {
            "runtime": verifier.runtime, "model": verifier.model_name, "dtype": verifier.dtype,
            "vocab_size": verifier.vocab_size, "hidden_size": verifier.hidden_size,
            "num_layers": verifier.num_layers,
        },
        "target_layer_ids": list(ids), "max_new_tokens": max_new_tokens, "max_seq_len": max_seq_len,
        "temperature": temperature, "kl_topk": kl_topk, "seed": seed,
    }  # fmt: skip
    index = _read_index(out)
    if index is None:
        index = {"format": DATA_FORMAT, "version": DATA_VERSION, **settings}
        index.update(shards=[], sequences=[], skipped={})
    else:
        diff = {k: (index.get(k), v) for k, v in settings.items() if index.get(k) != v}
        if index.get("format") != DATA_FORMAT or diff:
            raise ValueError(
                f"dataset {str(out)!r} was built with other settings {diff} (stored, asked): use a new "
                "directory or the same settings"
            )
    if not (out / HEADS_NAME).is_file():
        from safetensors.torch import save_file

        from specdec.api import torch_dtype

        tensors, cap = extract_heads(verifier)
        try:
            store = torch_dtype(verifier.dtype)
        except ValueError:
            store = torch.float32
        tensors = {k: v.to(store).contiguous() for k, v in tensors.items()}
        save_file(tensors, str(out / HEADS_NAME), metadata={"softcap": str(cap) if cap else "none"})

    items = _normalise_prompts(prompts)
    if max_prompts is not None:
        items = items[:max_prompts]
    done = {s["id"] for s in index["sequences"]} | set(index["skipped"])
    todo = [(i, pid, p) for i, (pid, p) in enumerate(items) if pid not in done]
    if not todo:
        return out

    from tqdm import tqdm

    bar = tqdm(total=len(todo), desc="build", unit="seq", disable=not progress, file=sys.stderr)
    buffer: list[dict[str, Any]] = []
    n_tok, t0 = 0, time.perf_counter()

    def flush() -> None:
        if buffer:
            shard = f"shard-{len(index['shards']):05d}.pt"
            payload = {k: [b[k] for b in buffer] for k in buffer[0] if k != "row"}
            torch.save(payload, out / (shard + ".tmp"))
            os.replace(out / (shard + ".tmp"), out / shard)
            index["shards"].append(shard)
            index["sequences"] += [{**b["row"], "shard": shard, "index": r} for r, b in enumerate(buffer)]
            buffer.clear()
        _atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=1))

    hf = _is_hf(verifier)
    group_size = batch_size if hf else 1
    try:
        for j in range(0, len(todo), group_size):
            group = todo[j : j + group_size]
            encoded, budgets, keep = [], [], []
            for i, pid, p in group:
                toks = encode_prompt(verifier, p)
                budget = min(max_new_tokens, max_seq_len - len(toks), verifier.max_context - len(toks))
                if not toks or budget < 1:
                    index["skipped"][pid] = (
                        f"prompt of {len(toks)} tokens leaves no room (max_seq_len {max_seq_len})"
                    )
                    continue
                encoded.append(toks)
                budgets.append(budget)
                keep.append((i, pid))
            if hf and encoded:
                responses = _generate_hf(verifier, encoded, budgets, temperature=temperature, seed=seed + j)
            else:
                responses = [
                    _generate_one(verifier, toks, b, temperature=temperature, seed=seed * 1_000_003 + i)
                    for toks, b, (i, _) in zip(encoded, budgets, keep)
                ]
            for toks, resp, (_, pid) in zip(encoded, responses, keep):
                seq = toks + resp
                feats, top_logp, top_ids = _teacher_forced(verifier, seq, ids, kl_topk)
                assert feats.shape == (len(seq), len(ids) * verifier.hidden_size), feats.shape
                rec: dict[str, Any] = {
                    "ids": torch.tensor(seq, dtype=torch.int32),
                    "features": feats.contiguous(),
                }
                if kl_topk:
                    rec.update(topk_logp=top_logp, topk_ids=top_ids)
                rec["row"] = {"id": pid, "prompt_len": len(toks), "length": len(seq)}
                buffer.append(rec)
                n_tok += len(seq) + len(resp)
            if len(buffer) >= shard_size:
                flush()
            bar.update(len(group))
            bar.set_postfix(tok_s=f"{n_tok / max(time.perf_counter() - t0, 1e-9):.0f}")
    finally:
        flush()
        bar.close()
    return out


class TrainData:
    """A built dataset: its index and memory-mapped shards."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        index = _read_index(self.path)
        if index is None or index.get("format") != DATA_FORMAT:
            raise FileNotFoundError(
                f"{str(self.path)!r} is not a specdec training dataset (no {INDEX_NAME}): "
                "run build_dataset first"
            )
        self.index = index
        self.sequences: list[dict[str, Any]] = index["sequences"]
        self.verifier: dict[str, Any] = index["verifier"]
        self.target_layer_ids: tuple[int, ...] = tuple(index["target_layer_ids"])
        self.kl_topk: int = int(index.get("kl_topk", 0))
        self._shards: dict[str, dict[str, list[torch.Tensor]]] = {}

    def __len__(self) -> int:
        return len(self.sequences)

    def get(self, i: int, key: str) -> torch.Tensor:
        """Tensor `key` ("ids", "features", "topk_logp", "topk_ids") of sequence i."""
        row = self.sequences[i]
        name = row["shard"]
        if name not in self._shards:
            self._shards[name] = torch.load(self.path / name, mmap=True, weights_only=True)
        return self._shards[name][key][row["index"]]


# ----------------------------------------------------------------------------------------------------------
# config


def default_gamma(block_size: int) -> float:
    """The paper's loss decay: 7 for bs 16, 5 for 10, 4 for 8; bs/2 up to 10 and 5 + (bs-10)/3 above."""
    return block_size / 2 if block_size <= 10 else 5 + (block_size - 10) / 3


@dataclass(kw_only=True)
class TrainConfig:
    """Drafter shape, optimisation and bookkeeping. Fields left None take the documented default."""

    # drafter shape (hidden size = the verifier's)
    num_layers: int = 5
    num_attention_heads: int | None = None  # None: max(1, hidden // 128)
    num_key_value_heads: int | None = None  # None: heads // 4 when divisible, else heads
    head_dim: int | None = None  # None: hidden // heads
    intermediate_size: int | None = None  # None: 3 * hidden
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None  # None: the dataset's (a subset of them is allowed)
    mask_token_id: int | None = None  # None: vocab_size - 1
    rope_theta: float = 1_000_000.0
    draft_vocab_size: int | None = None  # K: read out only the K ids most written in the data; None: all
    # optimisation
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    steps: int | None = None  # None: ceil(epochs * (training sequences // batch_size))
    epochs: float = 6.0
    batch_size: int = 4  # sequences per optimizer step, over all processes
    max_anchors: int = 512
    attn_chunk: int | None = None  # anchors per chunk; None: all at once
    gamma: float | None = None  # None: default_gamma(block_size)
    kl_weight: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    # warm start: a public-format checkpoint of the same drafter shape whose weights start this run (fresh
    # optimizer and schedule; its draft vocabulary is kept, so it may train on new data; with held-out
    # sequences it is evaluated at step 0); a checkpoint already in out_dir still wins (resume)
    init_from: str | None = None
    dtype: str = "float32"  # compute dtype: float32 or bfloat16 (autocast; master weights stay fp32)
    device: str | None = None  # None: cuda:LOCAL_RANK when available, else cpu
    # bookkeeping
    out_dir: str = "drafter-train"
    save_every: int | None = None  # None: only the final checkpoint
    keep_checkpoints: int = 2
    log_every: int = 1
    eval_every: int | None = None  # None: evaluate at the end only (when some sequences are held out)
    holdout: int = 0  # sequences held out of training for evaluation
    eval_max_new_tokens: int = 64
    eval_prompts: int = 4
    resume: bool = True
    progress: bool = True

    def validate(self) -> None:
        """Raise ValueError naming every bad field."""
        problems = []
        for name in (
            "num_layers",
            "batch_size",
            "max_anchors",
            "log_every",
            "keep_checkpoints",
            "eval_prompts",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            problems.append(f"block_size must be >= 2 (a block of 1 proposes nothing), got {self.block_size}")
        if self.lr <= 0:
            problems.append(f"lr must be > 0, got {self.lr}")
        if self.steps is not None and self.steps < 1:
            problems.append(f"steps must be >= 1 or None, got {self.steps}")
        if self.steps is None and self.epochs <= 0:
            problems.append(f"epochs must be > 0, got {self.epochs}")
        if self.attn_chunk is not None and self.attn_chunk < 1:
            problems.append(f"attn_chunk must be >= 1 or None, got {self.attn_chunk}")
        if self.gamma is not None and self.gamma <= 0:
            problems.append(f"gamma must be > 0, got {self.gamma}")
        if self.kl_weight < 0:
            problems.append(f"kl_weight must be >= 0, got {self.kl_weight}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            problems.append(f"draft_vocab_size must be >= 1 or None, got {self.draft_vocab_size}")
        if self.draft_vocab_size is not None and self.kl_weight > 0:
            problems.append("kl_weight > 0 with a draft_vocab_size is not supported (soft labels span all V)")
        if not 0 <= self.warmup_ratio < 1:
            problems.append(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip <= 0:
            problems.append(f"grad_clip must be > 0, got {self.grad_clip}")
        if self.dtype not in ("float32", "bfloat16"):
            problems.append(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.holdout < 0:
            problems.append(f"holdout must be >= 0, got {self.holdout}")
        for name in ("save_every", "eval_every"):
            v = getattr(self, name)
            if v is not None and v < 1:
                problems.append(f"{name} must be >= 1 or None, got {v}")
        if problems:
            raise ValueError("invalid TrainConfig: " + "; ".join(problems))


def drafter_config(cfg: TrainConfig, index: dict[str, Any]) -> DFlashConfig:
    """The DFlash config for `cfg` and a dataset index (its verifier description and captured layers)."""
    v = index["verifier"]
    H, V = int(v["hidden_size"]), int(v["vocab_size"])
    heads = cfg.num_attention_heads or max(1, H // 128)
    kv = cfg.num_key_value_heads or (heads // 4 if heads % 4 == 0 else heads)
    have = list(index["target_layer_ids"])
    ids = tuple(cfg.target_layer_ids) if cfg.target_layer_ids is not None else tuple(have)
    missing = [i for i in ids if i not in have]
    if missing:
        raise ValueError(
            f"target_layer_ids {list(ids)}: layers {missing} were not captured in the dataset "
            f"(it has {have}); rebuild it with those layers"
        )
    mask = V - 1 if cfg.mask_token_id is None else cfg.mask_token_id
    if not 0 <= mask < V:
        raise ValueError(f"mask_token_id {mask} outside the vocabulary 0..{V - 1}")
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size >= V:
        raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} must be below the vocabulary size {V}")
    # the draft vocabulary itself is chosen from the training data (`draft_vocabulary`) by `train`
    return DFlashConfig(
        hidden_size=H, num_hidden_layers=cfg.num_layers, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=cfg.head_dim or H // heads, intermediate_size=cfg.intermediate_size or 3 * H,
        vocab_size=V, num_target_layers=int(v["num_layers"]), mask_token_id=mask,
        block_size=cfg.block_size, target_layer_ids=ids, rope_theta=cfg.rope_theta,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# the loss: block-sparse forward chunk by chunk, the loss inside each chunk


@dataclass
class Batch:
    """One process's share of a step: sequences padded to a common length, anchors padded per sequence."""

    ids: torch.Tensor  # [B, T] int64
    features: torch.Tensor  # [B, T, K*H]
    anchors: torch.Tensor  # [B, A] int64 (padding: 0)
    valid: torch.Tensor  # [B, A] bool
    topk_logp: torch.Tensor | None = None  # [B, T, k] verifier log-probs of the token after each position
    topk_ids: torch.Tensor | None = None  # [B, T, k]


def _chunk_hidden(
    model: Any,
    ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
    anchors: torch.Tensor,
    x: torch.Tensor,
    T: int,
) -> torch.Tensor:
    """Hidden states [B, C, bs, H] after the final norm for anchors [B, C] and embedded blocks
    x [B, C, bs, H] against the context K/V of T positions: the per-chunk body of
    `DFlashDraftModel.forward_train`, with the context K/V computed once by the caller."""
    from specdec.dflash import _visible

    cfg = model.cfg
    B, C, bs, _ = x.shape
    dev = x.device
    ctx_pos = torch.arange(T, device=dev)  # [T]
    qpos = (anchors[:, :, None] + torch.arange(bs, device=dev)).reshape(B, C * bs)  # [B, C*bs]
    block_of = torch.arange(C, device=dev).repeat_interleave(bs)  # [C*bs]
    anc_q = anchors.repeat_interleave(bs, dim=1)  # [B, C*bs]
    m_ctx = ctx_pos[None, None, :] < anc_q[:, :, None]  # [B, C*bs, T]: context strictly before the anchor
    m_blk = (block_of[:, None] == block_of[None, :]).expand(B, -1, -1)  # [B, C*bs, C*bs]: own block only
    base = torch.cat([m_ctx, m_blk], dim=2)  # [B, C*bs, T + C*bs]
    kpos = torch.cat([ctx_pos.expand(B, T), qpos], dim=1)  # [B, T + C*bs]
    masks = {}
    for w in {layer.sliding_window for layer in model.layers}:
        extra = _visible(qpos, kpos, w, cfg.is_causal)
        masks[w] = base if extra is None else base & extra
    h = x.reshape(B, C * bs, -1).to(model.dtype)  # [B, C*bs, H]
    cos, sin = model.rope(qpos)
    for i, layer in enumerate(model.layers):

        def join(k: torch.Tensor, v: torch.Tensor, i: int = i) -> tuple[torch.Tensor, torch.Tensor]:
            ck, cv = ctx_kv[i]
            return torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2)  # [B, nkv, T + C*bs, D]

        h = layer(h, cos, sin, join, masks[layer.sliding_window])
    return model.norm(h).view(B, C, bs, -1)


def position_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """[bs-1] loss weights exp(-(k-1)/gamma) of block positions k = 1..bs-1."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def block_loss(
    model: Any,
    batch: Batch,
    embed_fn: EmbedFn,
    lm_head_fn: LMHeadFn,
    *,
    gamma: float,
    attn_chunk: int | None = None,
    kl_weight: float = 0.0,
    checkpoint: bool = True,
) -> dict[str, torch.Tensor]:
    """The weighted loss SUM (divide by the global `weight_sum`) and detached statistics of one batch.

    With several anchor chunks each runs under activation checkpointing (`checkpoint`), so the backward
    also holds one chunk's activations at a time. Returns {"loss_sum", "weight_sum", "correct", "count",
    "accept_sum", "n_anchors"}: top-1 `correct` of `count` supervised positions, and `accept_sum` the sum
    over anchors of 1 + the leading run of correct positions (teacher-forced acceptance length).
    """
    cfg = model.cfg
    bs, dev, mask_id = cfg.block_size, batch.ids.device, cfg.mask_token_id
    T, A = batch.ids.shape[1], batch.anchors.shape[1]
    posw = position_weights(bs, gamma, dev)  # [bs-1]
    offs = torch.arange(1, bs, device=dev)  # [bs-1]
    rows = getattr(model, "draft_vocab", None)  # [K]: `lm_head_fn` reads out these ids only
    col_of = None
    if rows is not None:  # [V] logit column of each vocabulary id, -1 outside the draft vocabulary
        col_of = torch.full((cfg.vocab_size,), -1, dtype=torch.long, device=dev)
        col_of[rows] = torch.arange(len(rows), device=dev)
    mask_col = mask_id if col_of is None else int(col_of[mask_id])
    ctx = model.project(batch.features.to(model.dtype))  # [B, T, H]
    ctx_kv = model.context_kv(ctx, torch.arange(T, device=dev)[None])  # per layer [B, nkv, T, D]
    flat_kv = [t for pair in ctx_kv for t in pair]
    chunk = attn_chunk or A

    def run(anc: torch.Tensor, valid: torch.Tensor, *kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blk = torch.full((*anc.shape, bs), mask_id, dtype=batch.ids.dtype, device=dev)
        blk[:, :, 0] = torch.gather(batch.ids, 1, anc)  # [B, C, bs]: [x_anchor, MASK...]
        hidden = _chunk_hidden(model, list(zip(kv[0::2], kv[1::2])), anc, embed_fn(blk), T)  # [B, C, bs, H]
        logits = lm_head_fn(hidden[:, :, 1:]).float()  # [B, C, bs-1, V] (K with a draft vocabulary)
        tpos = (anc[:, :, None] + offs).clamp(max=T - 1)  # [B, C, bs-1] label positions a+k
        labels = torch.gather(batch.ids, 1, tpos.flatten(1)).view_as(tpos)  # [B, C, bs-1]
        known = valid[:, :, None].expand_as(labels)  # [B, C, bs-1] supervised positions
        if col_of is not None:  # labels outside the draft vocabulary cannot be drafted: no loss, wrong
            labels = col_of[labels]
            known = known & (labels >= 0)
            labels = labels.clamp(min=0)
        logp = torch.log_softmax(logits, -1)
        w = known.float() * posw  # [B, C, bs-1]
        loss = (-logp.gather(-1, labels[..., None]).squeeze(-1) * w).sum()
        if kl_weight > 0:
            assert batch.topk_logp is not None and batch.topk_ids is not None
            k = batch.topk_logp.shape[-1]
            src = (tpos - 1).flatten(1)[..., None].expand(-1, -1, k)  # logits at a+k-1 give the token at a+k
            t_logp = torch.gather(batch.topk_logp, 1, src).view(*tpos.shape, k).float()
            t_ids = torch.gather(batch.topk_ids, 1, src).view(*tpos.shape, k).long()
            p_logp = torch.log_softmax(t_logp, -1)  # renormalised over the top k
            kl = (p_logp.exp() * (p_logp - logp.gather(-1, t_ids))).sum(-1)  # [B, C, bs-1]
            loss = loss + kl_weight * (kl * w).sum()
        with torch.no_grad():
            pred = logits.detach().clone()
            if 0 <= mask_col < pred.shape[-1]:
                pred[..., mask_col] = float("-inf")  # never proposed at inference
            ok = (pred.argmax(-1) == labels) & known  # [B, C, bs-1]
            run_len = torch.cumprod(ok.long(), -1).sum(-1)  # [B, C] leading correct positions
            n = valid.sum().float()
            stats = torch.stack([ok.sum().float(), n * (bs - 1), ((run_len + 1) * valid).sum().float(), n])
        return loss, stats

    loss_sum = torch.zeros((), device=dev)
    stats = torch.zeros(4, device=dev)
    use_ckpt = checkpoint and chunk < A and torch.is_grad_enabled()
    for c0 in range(0, A, chunk):
        anc, valid = batch.anchors[:, c0 : c0 + chunk], batch.valid[:, c0 : c0 + chunk]
        if use_ckpt:
            from torch.utils.checkpoint import checkpoint as ckpt

            loss, st = ckpt(run, anc, valid, *flat_kv, use_reentrant=False)
        else:
            loss, st = run(anc, valid, *flat_kv)
        loss_sum = loss_sum + loss
        stats = stats + st
    weight_sum = batch.valid.float().sum() * posw.sum()
    return {
        "loss_sum": loss_sum, "weight_sum": weight_sum, "correct": stats[0], "count": stats[1],
        "accept_sum": stats[2], "n_anchors": stats[3],
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# batching


def _seed_of(*parts: int) -> int:
    """A stable 63-bit seed from integers (FNV-1a style; Python's hash is not used)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p % (1 << 48))) * 1099511628211) % (1 << 63)
    return h


def anchor_range(prompt_len: int, length: int, block_size: int) -> tuple[int, int]:
    """[lo, hi] of the anchors whose block labels all lie in the response (empty when lo > hi)."""
    return max(prompt_len - 1, 0), length - block_size


def sample_anchors(
    prompt_len: int, length: int, block_size: int, max_anchors: int, seed: int
) -> torch.Tensor:
    """Sorted anchor positions [A], A = min(max_anchors, valid positions), drawn without replacement."""
    lo, hi = anchor_range(prompt_len, length, block_size)
    n = hi - lo + 1
    if n <= 0:
        return torch.zeros(0, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(n, generator=g)[: min(max_anchors, n)] + lo).sort().values


def collate(
    data: TrainData,
    idx: Sequence[int],
    anchors: Sequence[torch.Tensor],
    *,
    device: torch.device,
    cols: torch.Tensor | None = None,
    kl: bool = False,
) -> Batch:
    """Pad sequences `idx` of `data` (features columns `cols`, all when None) and their anchors."""
    B = len(idx)
    T = max(data.sequences[i]["length"] for i in idx)
    A = max(1, *(len(a) for a in anchors))
    ids = torch.zeros(B, T, dtype=torch.long)
    anc = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    feats = tl = ti = None
    for b, (i, a) in enumerate(zip(idx, anchors)):
        x = data.get(i, "ids")
        n = len(x)
        ids[b, :n] = x.long()
        f = data.get(i, "features")  # [n, K*H] bf16
        f = f if cols is None else f[:, cols]
        if feats is None:
            feats = torch.zeros(B, T, f.shape[1], dtype=f.dtype)
        feats[b, :n] = f
        anc[b, : len(a)] = a
        valid[b, : len(a)] = True
        if kl:
            lp, tid = data.get(i, "topk_logp"), data.get(i, "topk_ids")
            if tl is None:
                tl = torch.zeros(B, T, lp.shape[1], dtype=lp.dtype)
                ti = torch.zeros(B, T, lp.shape[1], dtype=torch.int32)
            tl[b, :n], ti[b, :n] = lp, tid
    assert feats is not None

    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return Batch(to(ids), to(feats), to(anc), to(valid), to(tl), to(ti))


# ----------------------------------------------------------------------------------------------------------
# distributed


@dataclass
class _Dist:
    rank: int
    world: int
    device: torch.device
    owned: bool  # this call initialised the process group (and destroys it)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.owned:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.owned = False


def _dist_setup(device: str | None) -> _Dist:
    """Rank / world from torchrun's env (RANK, WORLD_SIZE, LOCAL_RANK); gloo on CPU, nccl on CUDA."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        dev = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device(f"cuda:{local}")
    owned = False
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
            owned = True
    return _Dist(rank, world, dev, owned)


# ----------------------------------------------------------------------------------------------------------
# evaluation


def acceptance_length(
    verifier: Verifier, drafter: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64
) -> dict[str, Any]:
    """Mean acceptance length (bonus included) of `specdec.engine.generate` with `drafter` over token-id
    prompts; `drafter` is a DFlashDrafter, a DFlashDraftModel or a checkpoint folder."""
    from specdec.dflash import DFlashDrafter, DFlashDraftModel
    from specdec.engine import DecodeConfig, generate
    from specdec.records import summarize

    if isinstance(drafter, (str, os.PathLike)):
        dcfg, state = load_checkpoint(drafter)
        model = DFlashDraftModel(dcfg)
        model.load_state_dict(state)
        drafter = DFlashDrafter(model, name=Path(drafter).name)
    elif isinstance(drafter, DFlashDraftModel):
        drafter = DFlashDrafter(drafter)
    drafter.bind(verifier)
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, block_size=drafter.block_size)
    results = [generate(verifier, list(p), drafter=drafter, cfg=cfg) for p in prompts]
    s = summarize(results, block_size=drafter.block_size)
    return {
        "acceptance_length": s["acceptance_length_mean"], "n_steps": s["n_steps"],
        "per_position_acceptance": s["per_position_acceptance"],
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# training


def draft_vocabulary(data: TrainData, seqs: Sequence[int], k: int, mask_token_id: int) -> torch.Tensor:
    """[k] int64: the vocabulary ids the verifier writes most often in the responses of `seqs`, then the
    most frequent prompt ids, then the lowest ids (BPE merges come roughly in frequency order); never
    the mask token. Ties break towards the lower id, so the choice is deterministic."""
    V = int(data.verifier["vocab_size"])
    resp = torch.zeros(V, dtype=torch.float64)
    prompt = torch.zeros(V, dtype=torch.float64)
    for i in seqs:
        ids = data.get(i, "ids").long()  # [T]
        n = data.sequences[i]["prompt_len"]
        resp += torch.bincount(ids[n:], minlength=V).double()
        prompt += torch.bincount(ids[:n], minlength=V).double()
    resp[mask_token_id] = prompt[mask_token_id] = -1.0
    order = torch.arange(V)  # lexicographic by stable sorts, least significant key first
    for key in (prompt, resp):
        order = order[key[order].argsort(descending=True, stable=True)]
    return order[:k].sort().values


def _lr_lambda(total: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        prog = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    return f


def _checkpoints(out: Path) -> list[tuple[int, Path]]:
    found = []
    for p in out.glob("checkpoint-*"):
        tail = p.name.rsplit("-", 1)[-1]
        if tail.isdigit() and (p / STATE_NAME).is_file():
            found.append((int(tail), p))
    return sorted(found)


def _check_verifier(verifier: Verifier, stored: dict[str, Any]) -> None:
    mine = {
        "model": verifier.model_name, "vocab_size": verifier.vocab_size,
        "hidden_size": verifier.hidden_size, "num_layers": verifier.num_layers,
    }  # fmt: skip
    diff = {k: (stored.get(k), x) for k, x in mine.items() if stored.get(k) != x}
    if diff:
        raise ValueError(f"the verifier is not the one the dataset was built with: {diff} (dataset, given)")


def train(verifier: Verifier | None, dataset_dir: str | os.PathLike[str], cfg: TrainConfig) -> Path:
    """Train a DFlash drafter on a built dataset; returns the final checkpoint folder (public format).

    `verifier` None: the embedding / LM head come from the dataset's `heads.safetensors` and held-out
    evaluation is teacher-forced only; with a verifier its callbacks are used and held-out prompts are
    also decoded with the drafter (mean acceptance length). Resumes from the latest checkpoint in
    `cfg.out_dir` when `cfg.resume`. Under torchrun every process calls this with the same arguments.
    """
    cfg.validate()
    data = TrainData(dataset_dir)
    if verifier is not None:
        _check_verifier(verifier, data.verifier)
    dcfg = drafter_config(cfg, data.index)
    if cfg.kl_weight > 0 and not data.kl_topk:
        raise ValueError("kl_weight > 0 needs the verifier's soft labels: build the dataset with kl_topk > 0")
    ctx = _dist_setup(cfg.device)
    try:
        return _train(verifier, data, cfg, dcfg, ctx)
    finally:
        ctx.close()


def _same_drafter(path: str | Path, dcfg: DFlashConfig) -> tuple[list[str], dict[str, torch.Tensor]]:
    """(config fields where the checkpoint at `path` differs from `dcfg`, its checked weights)."""
    saved, state = load_checkpoint(path)
    have, want = saved.to_dict(), dcfg.to_dict()
    return sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k)), state


def _train(
    verifier: Verifier | None, data: TrainData, cfg: TrainConfig, dcfg: DFlashConfig, ctx: _Dist
) -> Path:
    from specdec.dflash import DFlashDraftModel

    bs, dev = dcfg.block_size, ctx.device
    gamma = cfg.gamma or default_gamma(bs)
    usable = []
    for i, s in enumerate(data.sequences):
        lo, hi = anchor_range(s["prompt_len"], s["length"], bs)
        if hi >= lo:
            usable.append(i)
    perm = torch.randperm(len(usable), generator=torch.Generator().manual_seed(_seed_of(cfg.seed, 1)))
    order = [usable[i] for i in perm.tolist()]
    held, train_idx = order[: cfg.holdout], sorted(order[cfg.holdout :])
    n_train = len(train_idx)
    if cfg.batch_size % ctx.world:
        raise ValueError(
            f"batch_size {cfg.batch_size} must be a multiple of the number of processes {ctx.world}"
        )
    if n_train < cfg.batch_size:
        raise ValueError(
            f"{n_train} training sequences ({len(data)} in the dataset, {len(data) - len(usable)} without a "
            f"full block of response for block_size {bs}, {len(held)} held out) are fewer than batch_size "
            f"{cfg.batch_size}"
        )
    per_epoch = n_train // cfg.batch_size
    total = cfg.steps or max(1, math.ceil(cfg.epochs * per_epoch))
    warmup = round(cfg.warmup_ratio * total)
    cols = None
    if tuple(dcfg.target_layer_ids) != data.target_layer_ids:
        H = dcfg.hidden_size
        pos = [data.target_layer_ids.index(layer) for layer in dcfg.target_layer_ids]
        cols = torch.cat([torch.arange(p * H, (p + 1) * H) for p in pos])

    if cfg.draft_vocab_size is not None and cfg.init_from is not None:
        # a warm start keeps the ids it learned to predict, whatever data it trains on now
        kept = load_config(cfg.init_from).draft_vocab
        if len(kept or ()) != cfg.draft_vocab_size:
            raise ValueError(
                f"cannot start from {cfg.init_from!r}: its draft_vocab holds {len(kept or ())} ids, this "
                f"run asks for draft_vocab_size {cfg.draft_vocab_size}"
            )
        dcfg = dataclasses.replace(dcfg, draft_vocab=kept)
    elif cfg.draft_vocab_size is not None:  # from the training split only
        vocab = draft_vocabulary(data, train_idx, cfg.draft_vocab_size, dcfg.mask_token_id)
        dcfg = dataclasses.replace(dcfg, draft_vocab=tuple(vocab.tolist()))
    torch.manual_seed(cfg.seed)
    model = DFlashDraftModel(dcfg).to(dev).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(total, warmup, cfg.min_lr_ratio))
    out = Path(cfg.out_dir)
    start = 0
    found = _checkpoints(out) if cfg.resume else []
    if found:
        start, path = found[-1]
        diff, state = _same_drafter(path, dcfg)
        if diff:
            raise ValueError(
                f"cannot resume from {str(path)!r}: it holds a drafter of another shape (differs in {diff}); "
                "use another out_dir or resume=False"
            )
        model.load_state_dict({k: v.to(dev) for k, v in state.items()})
        st = torch.load(path / STATE_NAME, map_location=dev, weights_only=False)
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        assert int(st["step"]) == start
    elif cfg.init_from is not None:
        diff, state = _same_drafter(cfg.init_from, dcfg)
        if diff:
            raise ValueError(
                f"cannot start from {cfg.init_from!r}: its drafter differs from this run's in {diff}; "
                "train with the shape, layers, block size and data (draft vocabulary) it was trained with"
            )
        model.load_state_dict({k: v.to(device=dev, dtype=torch.float32) for k, v in state.items()})
    rows = model.draft_vocab
    if verifier is not None:
        embed_fn = verifier.embed_fn(device=dev, dtype=torch.float32)
        head_fn = verifier.lm_head_fn(device=dev, dtype=torch.float32, rows=rows)
    else:
        embed_fn, head_fn = load_heads(data.path, device=dev, rows=rows)
    if ctx.main:
        out.mkdir(parents=True, exist_ok=True)
    ctx.barrier()

    def autocast() -> torch.autocast:
        return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")

    kl = cfg.kl_weight > 0
    epoch_perm: dict[int, list[int]] = {}

    def batch_at(step: int) -> list[int]:
        e, j = divmod(step, per_epoch)
        if e not in epoch_perm:
            gen = torch.Generator().manual_seed(_seed_of(cfg.seed, 2, e))
            epoch_perm.clear()
            epoch_perm[e] = [train_idx[i] for i in torch.randperm(n_train, generator=gen).tolist()]
        return epoch_perm[e][j * cfg.batch_size : (j + 1) * cfg.batch_size]

    def anchors_for(i: int, step: int) -> torch.Tensor:
        s = data.sequences[i]
        return sample_anchors(
            s["prompt_len"], s["length"], bs, cfg.max_anchors, _seed_of(cfg.seed, 3, step, i)
        )

    def evaluate(step: int) -> dict[str, Any]:
        model.eval()
        res: dict[str, Any] = {"step": step, "eval": {}}
        try:
            tot = torch.zeros(4, device=dev)
            with torch.no_grad(), autocast():
                for i in held:
                    b = collate(data, [i], [anchors_for(i, -1)], device=dev, cols=cols, kl=kl)
                    r = block_loss(model, b, embed_fn, head_fn, gamma=gamma, attn_chunk=cfg.attn_chunk)
                    tot += torch.stack([r["correct"], r["count"], r["accept_sum"], r["n_anchors"]])
            res["eval"]["acc"] = float(tot[0] / tot[1].clamp(min=1))
            res["eval"]["tf_tau"] = float(tot[2] / tot[3].clamp(min=1))
            if verifier is not None:
                prompts = [data.get(i, "ids")[: data.sequences[i]["prompt_len"]].tolist() for i in held]
                acc = acceptance_length(
                    verifier, model, prompts[: cfg.eval_prompts], max_new_tokens=cfg.eval_max_new_tokens
                )
                res["eval"]["tau"] = acc["acceptance_length"]
        finally:
            model.train()
        return res

    from tqdm import tqdm

    log = open(out / LOG_NAME, "a") if ctx.main else None  # noqa: SIM115 (closed in finally)

    def write(rec: dict[str, Any]) -> None:
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    bar = tqdm(
        total=total, initial=start, desc="train", disable=not (cfg.progress and ctx.main), file=sys.stderr
    )
    t_last, win = time.perf_counter(), torch.zeros(6, dtype=torch.float64)  # stats + weight sums
    try:
        if held and start == 0 and cfg.init_from is not None:
            if ctx.main:
                write(evaluate(0))  # where the warm start begins, on this run's held-out sequences
            ctx.barrier()
        for step in range(start, total):
            local = batch_at(step)[ctx.rank :: ctx.world]
            batch = collate(data, local, [anchors_for(i, step) for i in local], device=dev, cols=cols, kl=kl)
            with autocast():
                r = block_loss(
                    model, batch, embed_fn, head_fn, gamma=gamma, attn_chunk=cfg.attn_chunk,
                    kl_weight=cfg.kl_weight,
                )  # fmt: skip
            denom = ctx.all_sum(r["weight_sum"].clone())
            (r["loss_sum"] / denom).backward()
            if (
                ctx.world > 1
            ):  # sum the gradients of the global batch (the loss is already globally normalised)
                flat = torch.cat(
                    [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]
                )
                ctx.all_sum(flat)
                for p, g in zip(params, flat.split([p.numel() for p in params])):
                    p.grad = g.view_as(p).clone()
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            st = torch.stack(
                [r["loss_sum"].detach(), r["correct"], r["count"], r["accept_sum"], r["n_anchors"]]
            )
            st = ctx.all_sum(st)
            win += torch.cat([st.cpu(), denom.reshape(1).cpu()])
            done = step + 1
            if done % cfg.log_every == 0 or done == total:
                now = time.perf_counter()
                rec = {
                    "step": done, "loss": float(st[0] / denom), "acc": float(st[1] / st[2].clamp(min=1)),
                    "tf_tau": float(st[3] / st[4].clamp(min=1)), "lr": lr, "grad_norm": float(gnorm),
                    # means over the steps since the last record (the per-step figures are noisy)
                    "loss_mean": float(win[0] / win[5]), "acc_mean": float(win[1] / win[2].clamp(min=1)),
                    "tf_tau_mean": float(win[3] / win[4].clamp(min=1)),
                    "tokens_per_s": float(win[2]) / max(now - t_last, 1e-9),
                }  # fmt: skip
                t_last, win = now, torch.zeros(6, dtype=torch.float64)
                bar.set_postfix(
                    loss=f"{rec['loss_mean']:.3f}",
                    acc=f"{rec['acc_mean']:.3f}",
                    tok_s=f"{rec['tokens_per_s']:.0f}",
                )
                write(rec)
            bar.update()
            if held and ((cfg.eval_every and done % cfg.eval_every == 0) or done == total):
                if ctx.main:
                    write(evaluate(done))
                ctx.barrier()
            if (cfg.save_every and done % cfg.save_every == 0) or done == total:
                if ctx.main:
                    _save(out, done, model, dcfg, opt, sched, cfg, data)
                ctx.barrier()
    finally:
        bar.close()
        if log is not None:
            log.close()
    return out / f"checkpoint-{total:06d}"


def _save(
    out: Path,
    step: int,
    model: Any,
    dcfg: DFlashConfig,
    opt: Any,
    sched: Any,
    cfg: TrainConfig,
    data: TrainData,
) -> Path:
    """checkpoint-NNNNNN/ (public format + trainer_state.pt), written to a temporary name and renamed."""
    path, tmp = out / f"checkpoint-{step:06d}", out / f".tmp-checkpoint-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(tmp, dcfg, {k: v.detach().float() for k, v in model.state_dict().items()})
    state = {
        "step": step, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
        "train_config": {f.name: getattr(cfg, f.name) for f in fields(cfg)}, "dataset": str(data.path),
    }  # fmt: skip
    torch.save(state, tmp / STATE_NAME)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    for _, old in _checkpoints(out)[: -cfg.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return path


# ----------------------------------------------------------------------------------------------------------
# command line: `specdec train` (wired by specdec.cli) and `python -m specdec.train` (e.g. under torchrun)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def add_train_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = TrainConfig()
    p.add_argument("--data", required=True, help="dataset directory (built first when --prompts is given)")
    p.add_argument("--out", required=True, help="output directory: checkpoint-NNNNNN/ and train_log.jsonl")
    g = p.add_argument_group("verifier and dataset")
    g.add_argument("--verifier", choices=("stub", "hf", "mlx"), help="needed to build data; enables tau eval")
    g.add_argument("--model", help="verifier model: short name or folder")
    g.add_argument("--verifier-dtype", default="float32")
    g.add_argument("--prompts", help="prompt file: JSONL with messages or text, or plain text lines")
    g.add_argument("--max-prompts", type=int)
    g.add_argument("--max-new-tokens", type=int, default=512)
    g.add_argument("--max-seq-len", type=int, default=3072)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--gen-batch-size", type=int, default=8, help="model.generate batch (HF verifier)")
    g.add_argument("--data-layer-ids", type=_ints, help="layers captured in the dataset, e.g. 1,9,17")
    g.add_argument("--kl-topk", type=int, default=0, help="cache the verifier's top-k log-probs (for KL)")
    g.add_argument("--build-only", action="store_true")
    t = p.add_argument_group("drafter and training")
    t.add_argument("--num-layers", type=int, default=d.num_layers)
    t.add_argument("--heads", type=int)
    t.add_argument("--kv-heads", type=int)
    t.add_argument("--head-dim", type=int)
    t.add_argument("--intermediate-size", type=int)
    t.add_argument("--block-size", type=int, default=d.block_size)
    t.add_argument("--target-layer-ids", type=_ints, help="default: the dataset's layers")
    t.add_argument("--mask-token-id", type=int)
    t.add_argument(
        "--draft-vocab", type=int, dest="draft_vocab_size",
        help="read out only the K ids the verifier writes most in the data (faster to train and run)",
    )  # fmt: skip
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--steps", type=int)
    t.add_argument("--epochs", type=float, default=d.epochs)
    t.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step, all processes")
    t.add_argument("--max-anchors", type=int, default=d.max_anchors)
    t.add_argument("--attn-chunk", type=int)
    t.add_argument("--gamma", type=float)
    t.add_argument("--kl-weight", type=float, default=d.kl_weight)
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument(
        "--init-from", help="checkpoint folder of the same drafter shape to start from (fresh optimizer)"
    )
    t.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16"))
    t.add_argument("--device")
    t.add_argument("--save-every", type=int)
    t.add_argument("--eval-every", type=int)
    t.add_argument("--holdout", type=int, default=d.holdout)
    t.add_argument("--no-resume", action="store_true")
    t.add_argument("--no-progress", action="store_true")
    return p


def cmd_train(args: argparse.Namespace) -> int:
    cfg = TrainConfig(
        num_layers=args.num_layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, intermediate_size=args.intermediate_size, block_size=args.block_size,
        target_layer_ids=args.target_layer_ids, mask_token_id=args.mask_token_id, lr=args.lr,
        draft_vocab_size=args.draft_vocab_size,
        steps=args.steps, epochs=args.epochs, batch_size=args.batch_size, max_anchors=args.max_anchors,
        attn_chunk=args.attn_chunk, gamma=args.gamma, kl_weight=args.kl_weight, seed=args.seed,
        init_from=args.init_from,
        dtype=args.dtype, device=args.device, out_dir=args.out, save_every=args.save_every,
        eval_every=args.eval_every, holdout=args.holdout, resume=not args.no_resume,
        progress=not args.no_progress,
    )  # fmt: skip
    cfg.validate()
    if args.prompts and not args.verifier:
        raise SystemExit("error: --prompts needs --verifier (the verifier writes the responses)")
    verifier = None
    if args.verifier:
        from specdec.api import load_verifier

        verifier = load_verifier(args.verifier, args.model, dtype=args.verifier_dtype)
    ctx = _dist_setup(args.device)  # under torchrun: one process group for building and training
    try:
        if args.prompts:
            if ctx.main:  # one builder; the other processes wait for the finished dataset
                build_dataset(
                    verifier, args.prompts, args.data, target_layer_ids=args.data_layer_ids,
                    max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len,
                    temperature=args.temperature, batch_size=args.gen_batch_size, kl_topk=args.kl_topk,
                    seed=args.seed, max_prompts=args.max_prompts, progress=not args.no_progress,
                )  # fmt: skip
            ctx.barrier()
        if args.build_only:
            return 0
        path = train(verifier, args.data, cfg)
        if ctx.main:
            print(path)
    finally:
        ctx.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.train", description="Train a DFlash drafter.")
    add_train_args(p)
    return cmd_train(p.parse_args(argv))
