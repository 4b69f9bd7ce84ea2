"""What a training run is: the drafter's shape, the data, optimisation and bookkeeping (`TrainConfig`),
and the DFlash config it trains (`drafter_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.drafting.dflash.config import DFlashConfig
from specdec.kernels import MAX_VERIFY_TOKENS

__all__ = ["TrainConfig", "default_layer_ids", "drafter_config"]


@dataclass(kw_only=True)
class TrainConfig:
    """Drafter shape, data, optimisation and bookkeeping. Fields left None take the documented default."""

    # drafter shape (hidden size = the verifier's)
    num_layers: int = 5
    num_attention_heads: int | None = None  # None: max(1, hidden // 128)
    num_key_value_heads: int | None = None  # None: heads // 4 when divisible, else heads
    head_dim: int | None = None  # None: hidden // heads
    intermediate_size: int | None = None  # None: 3 * hidden
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None  # None: min(5, L-3) evenly spaced from 1 to L-3
    mask_token_id: int | None = None  # None: vocab_size - 1
    rope_theta: float = 1_000_000.0
    draft_vocab_size: int | None = None  # K: read out only the K ids most written in the data; None: all
    # data
    stages: tuple[str, ...] | None = None  # corpus stages to train on; None: all
    max_sequences: int | None = None  # the first N sequences of those stages; None: all
    # optimisation
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    steps: int | None = None  # None: ceil(epochs * (training sequences // batch_size))
    epochs: float = 1.0
    batch_size: int = 4  # sequences per optimizer step, over all processes
    max_anchors: int = 512
    attn_chunk: int | None = None  # anchors per chunk; None: all at once
    # recompute each anchor chunk's forward in the backward instead of keeping its activations (saves
    # memory, costs a forward); None: on CUDA only. On a CPU memory is rarely the limit: SmolLM2 shape,
    # 8 x 96 anchors in chunks of 24, the drafter's step took 7.05 s with it and 4.60 s without.
    recompute: bool | None = None
    gamma: float | None = None  # None: default_gamma(block_size)
    kl_weight: float = 0.0
    # loss weight of block positions whose token repeats earlier text (`loss.repeats`); 1: none
    repeat_weight: float = 1.0
    # anchors whose first label repeats earlier text (`loss.repeats`: what prompt lookup would draft) are
    # drawn this many times as likely as the others, so more blocks start inside repeated spans; 1: uniform
    # (held-out evaluation always draws uniformly)
    repeat_anchors: float = 1.0
    kl_topk: int = 16  # soft labels: the verifier's top-k next tokens (with kl_weight > 0)
    grad_clip: float = 1.0
    seed: int = 0
    # warm start: a public-format checkpoint of the same drafter shape whose weights start this run (fresh
    # optimizer and schedule; its draft vocabulary is kept, so it may train on new data; with held-out
    # sequences it is evaluated at step 0); a checkpoint already in out_dir still wins (resume). One with
    # fewer layers grows into this run's depth, computing what it computed (`grow_layers`)
    init_from: str | None = None
    # or: the drafter's layers start as copies of these verifier decoder layers (one per drafter layer;
    # `layers_from_verifier`), for a drafter whose hidden size and layer shape are the verifier's
    init_layers: tuple[int, ...] | None = None
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
        p = []
        for name in (
            "num_layers",
            "batch_size",
            "max_anchors",
            "log_every",
            "keep_checkpoints",
            "eval_prompts",
        ):
            if getattr(self, name) < 1:
                p.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "attn_chunk", "save_every", "eval_every", "max_sequences", "draft_vocab_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                p.append(f"{name} must be >= 1 or None, got {v}")
        checks = [
            (
                2 <= self.block_size <= MAX_VERIFY_TOKENS,
                f"block_size must be 2..{MAX_VERIFY_TOKENS} (a block "
                f"of 1 drafts nothing, one verify holds at most {MAX_VERIFY_TOKENS}), got {self.block_size}",
            ),
            (bool(str(self.out_dir).strip()), "out_dir is empty; give a folder for the checkpoints"),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (self.repeat_weight > 0, f"repeat_weight must be > 0, got {self.repeat_weight}"),
            (self.repeat_anchors > 0, f"repeat_anchors must be > 0, got {self.repeat_anchors}"),
            (self.init_from is None or self.init_layers is None, "give init_from or init_layers, not both"),
            (self.steps is not None or self.epochs > 0, f"epochs must be > 0, got {self.epochs}"),
            (self.gamma is None or self.gamma > 0, f"gamma must be > 0, got {self.gamma}"),
            (self.kl_weight >= 0, f"kl_weight must be >= 0, got {self.kl_weight}"),
            (self.kl_topk >= 1, f"kl_topk must be >= 1, got {self.kl_topk}"),
            (
                self.draft_vocab_size is None or self.kl_weight == 0,
                "kl_weight > 0 with a draft_vocab_size is not supported (soft labels span all V)",
            ),
            (0 <= self.warmup_ratio < 1, f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}"),
            (0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"),
            (self.grad_clip > 0, f"grad_clip must be > 0, got {self.grad_clip}"),
            (self.holdout >= 0, f"holdout must be >= 0, got {self.holdout}"),
        ]
        p += [msg for ok, msg in checks if not ok]
        if p:
            raise ValueError("invalid TrainConfig: " + "; ".join(p))


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """min(5, L-3) layers evenly spaced from 1 to L-3 (the public default); L//2 for tiny targets."""
    from specdec.drafting.dflash.config import default_target_layer_ids

    return default_target_layer_ids(num_layers, max(1, min(5, num_layers - 3)))


def drafter_config(cfg: TrainConfig, verifier: dict[str, Any]) -> DFlashConfig:
    """The DFlash config for `cfg` and a verifier description (a corpus' "verifier" entry)."""
    H, V, L = int(verifier["hidden_size"]), int(verifier["vocab_size"]), int(verifier["num_layers"])
    heads = cfg.num_attention_heads or max(1, H // 128)
    kv = cfg.num_key_value_heads or (heads // 4 if heads % 4 == 0 else heads)
    ids = tuple(cfg.target_layer_ids) if cfg.target_layer_ids is not None else default_layer_ids(L)
    if not ids or any(not 0 <= i < L for i in ids):
        raise ValueError(f"target_layer_ids {list(ids)} must be non-empty within 0..{L - 1}")
    mask = V - 1 if cfg.mask_token_id is None else cfg.mask_token_id
    if not 0 <= mask < V:
        raise ValueError(f"mask_token_id {mask} outside the vocabulary 0..{V - 1}")
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size >= V:
        raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} must be below the vocabulary size {V}")
    return DFlashConfig(
        hidden_size=H,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=cfg.head_dim or H // heads,
        intermediate_size=cfg.intermediate_size or 3 * H,
        vocab_size=V,
        num_target_layers=L,
        mask_token_id=mask,
        block_size=cfg.block_size,
        target_layer_ids=ids,
        rope_theta=cfg.rope_theta,
    )
