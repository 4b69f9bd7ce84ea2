"""The training loop: config, schedule, data parallel, held-out evaluation, checkpoints and resume.

`train(verifier, corpus_dir, cfg)` trains a DFlash drafter on a corpus (`specdec.train.corpus`), the
verifier computing each batch's features (`specdec.train.features`) and lending its frozen embedding and LM
head. AdamW, warmup + cosine, grad clip; public-format checkpoints (`checkpoint-NNNNNN/`: config.json +
model.safetensors, plus optimizer / scheduler / step in `trainer_state.pt`), resumed from the latest one;
`train_log.jsonl`. Held out: teacher-forced top-1 accuracy and acceptance length (1 + the leading run of
correct positions per anchor) on held-out sequences, and the real mean acceptance length of the engine
with the drafter on held-out prompts.

Data parallel: under torchrun (env RANK / WORLD_SIZE) the loss runs inside torch's
DistributedDataParallel (gloo on CPU, nccl on CUDA), each rank taking a slice of the global batch and
computing its features with its own verifier. The loss is normalised by the global weight sum (times the
world size, which DDP's gradient averaging divides out), so 1 and N processes take the same steps.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdec.drafting.dflash.config import DFlashConfig, load_checkpoint, load_config, save_checkpoint
from specdec.protocols import EmbedFn, LMHeadFn, Verifier
from specdec.records import staging_dir
from specdec.train.config import TrainConfig, drafter_config
from specdec.train.data import (
    TrainData,
    anchor_range,
    batch_order,
    collate,
    draft_vocabulary,
    sample_anchors,
    seed_of,
)
from specdec.train.dist import Dist, dist_setup
from specdec.train.features import TargetFeatures
from specdec.train.loss import block_loss, default_gamma, repeats

__all__ = ["TrainConfig", "acceptance_length", "dist_setup", "drafter_config", "grow_layers", "train"]

STATE_NAME = "trainer_state.pt"
LOG_NAME = "train_log.jsonl"


def acceptance_length(
    verifier: Verifier, drafter: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64
) -> dict[str, Any]:
    """Mean acceptance length (bonus included) of `specdec.engine.generate` with `drafter` over token-id
    prompts; `drafter` is a DFlashDrafter, a DFlashDraftModel or a checkpoint folder."""
    from specdec.drafting.dflash.torch import DFlashDrafter, DFlashDraftModel
    from specdec.engine import decode_config, generate
    from specdec.records import summarize

    if isinstance(drafter, (str, os.PathLike)):
        dcfg, state = load_checkpoint(drafter)
        model = DFlashDraftModel(dcfg)
        model.load_state_dict(state)
        drafter = DFlashDrafter(model, name=Path(drafter).name)
    elif isinstance(drafter, DFlashDraftModel):
        drafter = DFlashDrafter(drafter)
    drafter.bind(verifier)
    cfg = decode_config(drafter, max_new_tokens=max_new_tokens)
    results = [generate(verifier, list(p), drafter=drafter, cfg=cfg) for p in prompts]
    s = summarize(results, block_size=drafter.block_size)
    return {
        "acceptance_length": s["acceptance_length_mean"],
        "n_steps": s["n_steps"],
        "per_position_acceptance": s["per_position_acceptance"],
    }


# ---- distributed -----------------------------------------------------------------------------------------


class _Loss(nn.Module):
    """`block_loss` as a module forward, so torch's DDP can wrap it (its hooks need a forward call)."""

    def __init__(
        self,
        model: nn.Module,
        embed_fn: EmbedFn,
        head_fn: LMHeadFn,
        gamma: float,
        cfg: TrainConfig,
        recompute: bool,
    ):
        super().__init__()
        self.model, self.embed_fn, self.head_fn, self.gamma, self.cfg = model, embed_fn, head_fn, gamma, cfg
        self.recompute = recompute

    def forward(self, batch: Any, kl_weight: float) -> dict[str, torch.Tensor]:
        return block_loss(
            self.model,
            batch,
            self.embed_fn,
            self.head_fn,
            gamma=self.gamma,
            attn_chunk=self.cfg.attn_chunk,
            kl_weight=kl_weight,
            checkpoint=self.recompute,
            repeat_weight=self.cfg.repeat_weight,
        )


# ---- training ------------------------------------------------------------------------------------------


def _lr_lambda(total: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        prog = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

    return f


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the resumable checkpoints in `out`, oldest first."""
    found = []
    for p in out.glob("checkpoint-*"):
        tail = p.name.rsplit("-", 1)[-1]
        if tail.isdigit() and (p / STATE_NAME).is_file():
            found.append((int(tail), p))
    return sorted(found)


def _same_drafter(path: str | Path, dcfg: DFlashConfig) -> tuple[list[str], dict[str, torch.Tensor]]:
    """(config fields where the checkpoint at `path` differs from `dcfg`, its checked weights)."""
    saved, state = load_checkpoint(path)
    have, want = saved.to_dict(), dcfg.to_dict()
    return sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k)), state


def grow_layers(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A checkpoint's weights for a deeper `model` (same shape otherwise) that computes what the checkpoint
    computed: its layers come first, and each layer after them starts as the identity, a pre-norm residual
    layer whose output projections (o_proj, down_proj) are zero, so x + 0 + 0; their other weights keep
    `model`'s own initialisation, and they learn from the first step (the zero projections get gradients)."""
    have = {int(k.split(".")[1]) for k in state if k.startswith("layers.")}
    grown = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grown.update(state)
    for k in grown:
        parts = k.split(".")
        if parts[0] == "layers" and int(parts[1]) not in have and parts[3] in ("o_proj", "down_proj"):
            grown[k] = torch.zeros_like(grown[k])
    return grown


def layers_from_verifier(
    model: nn.Module, verifier: Verifier, layer_ids: Sequence[int]
) -> dict[str, torch.Tensor]:
    """`model`'s weights with drafter layer j a copy of verifier decoder layer `layer_ids[j]` (projections and
    norms, the shapes must agree), its q_norm / k_norm at one (the verifier's layers have none: the closest
    to leaving q and k as they are), the final norm the verifier's, and `fc` reading only the features of the
    target layer just below the first copied one (so the context enters the copied layers about where the
    verifier's own context would), the rest of `fc` at zero. An HF verifier only (it holds the layers as
    torch modules)."""
    src = getattr(getattr(getattr(verifier, "model", None), "model", None), "layers", None)
    if not isinstance(src, nn.ModuleList):
        raise ValueError(
            f"init_layers needs an HF verifier (decoder layers as torch modules), got {verifier.runtime!r}"
        )
    cfg = model.cfg
    if len(layer_ids) != cfg.num_hidden_layers or not all(0 <= i < len(src) for i in layer_ids):
        raise ValueError(
            f"init_layers {list(layer_ids)}: give {cfg.num_hidden_layers} ids (one per drafter layer) in "
            f"0..{len(src) - 1}"
        )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for j, i in enumerate(layer_ids):
        for k, v in src[i].state_dict().items():
            key = f"layers.{j}.{k}"
            if key not in state or state[key].shape != v.shape:
                raise ValueError(
                    f"init_layers: verifier layer {i}'s {k} {tuple(v.shape)} has no place in the drafter"
                )
            state[key] = v.detach().float().clone()
        for n in ("q_norm", "k_norm"):
            state[f"layers.{j}.self_attn.{n}.weight"].fill_(1.0)
    state["norm.weight"] = verifier.model.model.norm.weight.detach().float().clone()
    below = [t for t, lid in enumerate(cfg.target_layer_ids) if lid < layer_ids[0]]
    fc = torch.zeros_like(state["fc.weight"])  # [H, K*H]
    if below:
        H = cfg.hidden_size
        fc[:, below[-1] * H : (below[-1] + 1) * H] = torch.eye(H)
    state["fc.weight"] = fc
    return state


def _check_verifier(verifier: Verifier, stored: dict[str, Any]) -> None:
    mine = {
        "model": verifier.model_name,
        "vocab_size": verifier.vocab_size,
        "hidden_size": verifier.hidden_size,
        "num_layers": verifier.num_layers,
    }
    diff = {k: (stored.get(k), x) for k, x in mine.items() if stored.get(k) != x}
    if diff:
        raise ValueError(f"the verifier is not the one the corpus was built with: {diff} (corpus, given)")


def train(verifier: Verifier, corpus_dir: str | os.PathLike[str], cfg: TrainConfig) -> Path:
    """Train a DFlash drafter on a corpus; returns the final checkpoint folder (public format). Resumes
    from the latest checkpoint in `cfg.out_dir` when `cfg.resume`. Under torchrun every process calls this
    with the same arguments."""
    cfg.validate()
    data = TrainData(corpus_dir, stages=cfg.stages, max_sequences=cfg.max_sequences)
    _check_verifier(verifier, data.verifier)
    dcfg = drafter_config(cfg, data.verifier)
    ctx = dist_setup(cfg.device)
    run = None
    try:
        run = _Run(verifier, data, cfg, dcfg, ctx)
        return run.fit()
    finally:
        # the DDP wrapper lets go of the process group before it is destroyed: a reducer left for the
        # interpreter's exit is torn down with a gloo thread still joinable ("terminate called without an
        # active exception", SIGABRT in one process of 2-process runs now and then: 3 of 80 minimal runs
        # before, 0 of 150 with this order; docs/training.md)
        del run
        gc.collect()
        ctx.close()


class _Run:
    """One training run: the split, the schedule, the model and optimizer (fresh, warm-started or
    resumed), and the step, evaluation and checkpoint of the loop in `fit`."""

    def __init__(self, verifier: Verifier, data: TrainData, cfg: TrainConfig, dcfg: DFlashConfig, ctx: Dist):
        self.verifier, self.data, self.cfg, self.ctx = verifier, data, cfg, ctx
        bs = dcfg.block_size
        spans = [anchor_range(s.prompt_len, len(s.ids), bs) for s in data.sequences]
        usable = [i for i, (lo, hi) in enumerate(spans) if hi >= lo]  # a full block of response somewhere
        perm = torch.randperm(len(usable), generator=torch.Generator().manual_seed(seed_of(cfg.seed, 1)))
        order = [usable[i] for i in perm.tolist()]
        self.held, self.train_idx = order[: cfg.holdout], sorted(order[cfg.holdout :])
        if cfg.batch_size % ctx.world:
            raise ValueError(
                f"batch_size {cfg.batch_size} must be a multiple of the number of processes {ctx.world}"
            )
        if len(self.train_idx) < cfg.batch_size:
            raise ValueError(
                f"{len(self.train_idx)} training sequences ({len(data)} in the corpus, "
                f"{len(data) - len(usable)} "
                f"without a full block of response for block_size {bs}, {len(self.held)} held out) are fewer "
                f"than batch_size {cfg.batch_size}"
            )
        self.per_epoch = len(self.train_idx) // cfg.batch_size
        self.total = cfg.steps or max(1, math.ceil(cfg.epochs * self.per_epoch))
        self.dcfg = self._draft_vocab(dcfg)
        self.features = TargetFeatures(
            verifier, self.dcfg.target_layer_ids, topk=cfg.kl_topk if cfg.kl_weight else 0
        )
        self.out = Path(cfg.out_dir)
        self._build_model()
        self.start = self._resume_or_init()
        self._epoch: tuple[int, list[list[int]]] | None = None

    def _draft_vocab(self, dcfg: DFlashConfig) -> DFlashConfig:
        cfg = self.cfg
        if cfg.draft_vocab_size is None:
            return dcfg
        if cfg.init_from is not None:  # a warm start keeps the ids it learned to predict, whatever the data
            kept = load_config(cfg.init_from).draft_vocab
            if len(kept or ()) != cfg.draft_vocab_size:
                raise ValueError(
                    f"cannot start from {cfg.init_from!r}: its draft_vocab holds {len(kept or ())} ids, this "
                    f"run asks for draft_vocab_size {cfg.draft_vocab_size}"
                )
            return dataclasses.replace(dcfg, draft_vocab=kept)
        vocab = draft_vocabulary(self.data, self.train_idx, cfg.draft_vocab_size, dcfg.mask_token_id)
        return dataclasses.replace(dcfg, draft_vocab=tuple(vocab.tolist()))

    def _build_model(self) -> None:
        from specdec.drafting.dflash.torch import DFlashDraftModel

        cfg, dev = self.cfg, self.ctx.device
        torch.manual_seed(cfg.seed)
        self.model = DFlashDraftModel(self.dcfg).to(dev).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        warmup = round(cfg.warmup_ratio * self.total)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, _lr_lambda(self.total, warmup, cfg.min_lr_ratio)
        )
        self.embed_fn = self.verifier.embed_fn(device=dev, dtype=torch.float32)
        self.head_fn = self.verifier.lm_head_fn(device=dev, dtype=torch.float32, rows=self.model.draft_vocab)
        gamma = cfg.gamma or default_gamma(self.dcfg.block_size)
        recompute = dev.type == "cuda" if cfg.recompute is None else cfg.recompute
        self.loss = _Loss(self.model, self.embed_fn, self.head_fn, gamma, cfg, recompute)
        self.local_loss = self.loss
        if self.ctx.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [dev.index] if dev.type == "cuda" else None
            self.loss = DistributedDataParallel(self.local_loss, device_ids=ids)

    def _resume_or_init(self) -> int:
        cfg, dev = self.cfg, self.ctx.device
        found = checkpoints(self.out) if cfg.resume else []
        if found:
            start, path = found[-1]
            diff, state = _same_drafter(path, self.dcfg)
            if diff:
                raise ValueError(
                    f"cannot resume from {str(path)!r}: it holds a drafter of another shape (differs in "
                    f"{diff}); use another out_dir or resume=False"
                )
            st = torch.load(path / STATE_NAME, map_location=dev, weights_only=False)
            was = (st.get("n_train", len(self.train_idx)), st.get("total", self.total))
            if was != (len(self.train_idx), self.total):
                raise ValueError(
                    f"cannot resume from {str(path)!r}: it trained on {was[0]} sequences for {was[1]} steps, "
                    f"this run has {len(self.train_idx)} and {self.total} (the corpus grew?); pin it with "
                    "max_sequences / steps, or start a new out_dir (init_from the checkpoint)"
                )
            self.model.load_state_dict({k: v.to(dev) for k, v in state.items()})
            self.opt.load_state_dict(st["optimizer"])
            self.sched.load_state_dict(st["scheduler"])
            assert int(st["step"]) == start
            return start
        if cfg.init_from is not None:
            diff, state = _same_drafter(cfg.init_from, self.dcfg)
            have = load_config(cfg.init_from).num_hidden_layers
            if set(diff) == {"num_hidden_layers", "layer_types"} and have < self.dcfg.num_hidden_layers:
                state, diff = grow_layers(state, self.model), []
            if diff:
                raise ValueError(
                    f"cannot start from {cfg.init_from!r}: its drafter differs from this run's in {diff}; "
                    "train with the shape, block size and data (draft vocabulary) it was trained with, and "
                    "at least its layers"
                )
            self.model.load_state_dict({k: v.to(device=dev, dtype=torch.float32) for k, v in state.items()})
        elif cfg.init_layers is not None:
            state = layers_from_verifier(self.model, self.verifier, cfg.init_layers)
            self.model.load_state_dict({k: v.to(dev) for k, v in state.items()})
        return 0

    # ---- the pieces of a step ------------------------------------------------------------------------

    def batch_at(self, step: int) -> list[int]:
        """The global batch of `step` (sequence indices), length-grouped, seeded by (seed, epoch)."""
        e, j = divmod(step, self.per_epoch)
        if self._epoch is None or self._epoch[0] != e:
            lengths = [len(self.data.sequences[i].ids) for i in self.train_idx]
            order = batch_order(lengths, self.cfg.batch_size, seed_of(self.cfg.seed, 2, e))
            self._epoch = (e, [[self.train_idx[i] for i in b] for b in order])
        return self._epoch[1][j]

    def anchors_for(self, i: int, step: int) -> torch.Tensor:
        """Sequence i's anchors at `step` (-1: held-out evaluation, always uniform)."""
        s, cfg = self.data.sequences[i], self.cfg
        weights = None
        if cfg.repeat_anchors != 1.0 and step >= 0:
            # [T] weight of anchor a: repeat_anchors where its first label a+1 repeats earlier text
            first = torch.zeros(len(s.ids), dtype=torch.bool)
            first[:-1] = repeats(torch.tensor([s.ids.tolist()]))[0, 1:]
            weights = 1.0 + (cfg.repeat_anchors - 1.0) * first.double()
        seed = seed_of(cfg.seed, 3, step, i)
        bs = self.dcfg.block_size
        return sample_anchors(s.prompt_len, len(s.ids), bs, cfg.max_anchors, seed, weights=weights)

    def batch(self, idx: list[int], step: int) -> Any:
        anchors = [self.anchors_for(i, step) for i in idx]
        return collate(self.data, idx, anchors, features=self.features, device=self.ctx.device)

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """One optimizer step; (global stats [loss_sum, correct, count, accept_sum, n_anchors], global weight
        sum, grad norm, lr)."""
        ctx = self.ctx
        local = self.batch_at(step)[ctx.rank :: ctx.world]
        r = self.loss(self.batch(local, step), self.cfg.kl_weight)
        denom = ctx.all_sum(r["weight_sum"].detach().clone())
        (r["loss_sum"] * ctx.world / denom).backward()  # DDP averages over ranks: a global-batch gradient
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))  # alike on every rank
        st = torch.stack([r["loss_sum"].detach(), r["correct"], r["count"], r["accept_sum"], r["n_anchors"]])
        st = ctx.all_sum(st)
        if not (math.isfinite(gnorm) and math.isfinite(float(st[0]))):  # before the weights take it
            raise RuntimeError(
                f"training stopped at step {step + 1}: the loss ({float(st[0] / denom):g}) or its gradient "
                f"(norm {gnorm:g}) is not finite; the weights were not updated with it, and the checkpoints "
                "saved before are good (lower --lr, --repeat-weight or --kl-weight)"
            )
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return st, denom, gnorm, lr

    def evaluate(self, step: int) -> dict[str, Any]:
        """Held-out teacher-forced accuracy / acceptance length, and the engine's acceptance length."""
        self.model.eval()
        res: dict[str, Any] = {"step": step, "eval": {}}
        try:
            tot = torch.zeros(4, device=self.ctx.device)
            with torch.no_grad():
                for i in self.held:
                    r = self.local_loss(self.batch([i], -1), 0.0)  # no DDP hooks: rank 0 alone
                    tot += torch.stack([r["correct"], r["count"], r["accept_sum"], r["n_anchors"]])
            res["eval"]["acc"] = float(tot[0] / tot[1].clamp(min=1))
            res["eval"]["tf_tau"] = float(tot[2] / tot[3].clamp(min=1))
            seqs = [self.data.sequences[i] for i in self.held[: self.cfg.eval_prompts]]
            prompts = [s.ids[: s.prompt_len].tolist() for s in seqs]
            acc = acceptance_length(
                self.verifier, self.model, prompts, max_new_tokens=self.cfg.eval_max_new_tokens
            )
            res["eval"]["tau"] = acc["acceptance_length"]
        finally:
            self.model.train()
        return res

    def save(self, step: int) -> Path:
        """checkpoint-NNNNNN/ (public format + trainer_state.pt), written to a temporary name and renamed."""
        path = self.out / f"checkpoint-{step:06d}"
        tmp = staging_dir(self.out, path.name)
        save_checkpoint(tmp, self.dcfg, {k: v.detach().float() for k, v in self.model.state_dict().items()})
        state = {
            "step": step,
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "n_train": len(self.train_idx),
            "total": self.total,
            "train_config": {f.name: getattr(self.cfg, f.name) for f in fields(self.cfg)},
            "corpus": str(self.data.path),
        }
        torch.save(state, tmp / STATE_NAME)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        for stale in self.out.glob(".checkpoint-*.tmp"):  # staging folders of saves that were interrupted
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
        for _, old in checkpoints(self.out)[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    # ---- the loop ------------------------------------------------------------------------------------

    def fit(self) -> Path:
        from tqdm import tqdm

        cfg, ctx = self.cfg, self.ctx
        if ctx.main:
            self.out.mkdir(parents=True, exist_ok=True)
        ctx.barrier()
        log = open(self.out / LOG_NAME, "a") if ctx.main else None  # noqa: SIM115 (closed in finally)

        def write(rec: dict[str, Any]) -> None:
            if log is not None:
                log.write(json.dumps(rec) + "\n")
                log.flush()

        def on_main(f: Callable[[], Any]) -> None:
            if ctx.main:
                f()
            ctx.barrier()

        quiet = not (cfg.progress and ctx.main)
        bar = tqdm(total=self.total, initial=self.start, desc="train", disable=quiet, file=sys.stderr)
        win, t_last = torch.zeros(6, dtype=torch.float64), time.perf_counter()  # stats + weight sums
        try:
            if self.held and self.start == 0 and (cfg.init_from or cfg.init_layers) is not None:
                on_main(lambda: write(self.evaluate(0)))  # where the warm start begins
            for step in range(self.start, self.total):
                st, denom, gnorm, lr = self.step(step)
                win += torch.cat([st.cpu(), denom.reshape(1).cpu()])
                done = step + 1
                if done % cfg.log_every == 0 or done == self.total:
                    now = time.perf_counter()
                    rec = _log_record(done, st, denom, win, lr, gnorm, now - t_last)
                    t_last, win = now, torch.zeros(6, dtype=torch.float64)
                    bar.set_postfix(
                        loss=f"{rec['loss_mean']:.3f}",
                        acc=f"{rec['acc_mean']:.3f}",
                        tok_s=f"{rec['tokens_per_s']:.0f}",
                    )
                    write(rec)
                bar.update()
                if self.held and ((cfg.eval_every and done % cfg.eval_every == 0) or done == self.total):
                    on_main(lambda d=done: write(self.evaluate(d)))
                if (cfg.save_every and done % cfg.save_every == 0) or done == self.total:
                    on_main(lambda d=done: self.save(d))
        finally:
            bar.close()
            if log is not None:
                log.close()
        return self.out / f"checkpoint-{self.total:06d}"


def _log_record(
    done: int, st: torch.Tensor, denom: torch.Tensor, win: torch.Tensor, lr: float, gnorm: float, dt: float
) -> dict[str, Any]:
    """A train_log.jsonl row: this step's figures and the means since the last row (steps are noisy);
    tokens_per_s counts supervised block positions over the wall time since the last row."""
    return {
        "step": done,
        "loss": float(st[0] / denom),
        "acc": float(st[1] / st[2].clamp(min=1)),
        "tf_tau": float(st[3] / st[4].clamp(min=1)),
        "lr": lr,
        "grad_norm": gnorm,
        "loss_mean": float(win[0] / win[5]),
        "acc_mean": float(win[1] / win[2].clamp(min=1)),
        "tf_tau_mean": float(win[3] / win[4].clamp(min=1)),
        "tokens_per_s": float(win[2]) / max(dt, 1e-9),
    }
