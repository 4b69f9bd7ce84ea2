"""From a `--drafter` value to a bound drafter: checked whole before anything loads, then loaded from what
the check read (a checkpoint's header is read once per run).

    plan = check_drafter("bundled:smollm2-135m+lookup")      # spec, checkpoint config and weights header
    check_drafter_fits(plan, model_shape("hf", "smollm2-135m"))   # against the model, before it loads
    drafter = load_drafter(plan, verifier=v, ...)             # the weights, once, and bind
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.drafting.lookup import LOOKUP_BLOCK_SIZE
from specdec.drafting.registry import Checkpoint, read_checkpoint
from specdec.drafting.spec import DrafterSpec
from specdec.dtypes import check_device_dtype, torch_dtype
from specdec.protocols import Drafter, Verifier

__all__ = [
    "DRAFTER_RUNTIMES", "DrafterPlan", "check_drafter", "check_drafter_fits", "check_drafter_runtimes",
    "check_kind_runtime", "load_drafter",
]  # fmt: skip

DRAFTER_RUNTIMES = ("torch", "mlx")


@dataclass(frozen=True)
class DrafterPlan:
    """A `--drafter` value checked before anything loads: its spec and, for a checkpoint, the checkpoint as
    read (`registry.Checkpoint`: folder, kind, header)."""

    spec: DrafterSpec
    checkpoint: Checkpoint | None = None

    @property
    def block_size(self) -> int | None:
        """A checkpoint's block size (its header's), else None."""
        return getattr(self.checkpoint.header, "block_size", None) if self.checkpoint else None

    @property
    def trees(self) -> bool:
        """It can propose trees (`--tree`): a checkpoint kind that does."""
        return self.checkpoint is not None and self.checkpoint.kind.trees


def check_drafter(spec: str | DrafterSpec | DrafterPlan | None) -> DrafterPlan:
    """A drafter spec checked before any model loads: its grammar, a checkpoint's format, config and weights
    header (names, shapes, truncation; a hub repo id is fetched into its cache), a draft model's name."""
    if isinstance(spec, DrafterPlan):
        return spec
    spec = DrafterSpec.parse(spec)
    if spec.kind == "model":
        from specdec.drafting.model import check_draft_model

        check_draft_model(spec.source)
        return DrafterPlan(spec)
    if spec.kind == "checkpoint":
        return DrafterPlan(spec, read_checkpoint(spec))
    return DrafterPlan(spec)


def check_drafter_fits(plan: DrafterPlan, target: Any, *, target_folder: Path | None = None) -> None:
    """A checked drafter against the verifier's model as far as it is known (`target`: a verifier, or
    `specdec.models.model_shape` before it loads; None: nothing to check yet): a checkpoint by its kind's
    `fits` (target layers, hidden size, vocabulary, with the offending values); a draft model by its
    vocabulary and, where both folders are on disk (`target_folder`), its tokenizer."""
    if target is None:
        return
    if plan.spec.base.kind == "mtp":
        if target_folder is not None:
            from specdec.drafting.mtp import check_mtp_folder

            check_mtp_folder(target_folder)
    elif plan.spec.kind == "model":
        from specdec.drafting.model import check_draft_model_fits

        check_draft_model_fits(plan.spec.source, target, folder=target_folder)
    elif plan.checkpoint is not None:
        plan.checkpoint.kind.fits(plan.checkpoint.header, target, plan.spec.text)


def check_drafter_runtimes(verifier: str, runtimes: Sequence[str]) -> None:
    """Before any load: a drafter in MLX reads the verifier's features as MLX arrays."""
    if "mlx" in runtimes and verifier != "mlx":
        raise ValueError("drafter runtime mlx needs --verifier mlx (its features stay MLX arrays)")


def check_kind_runtime(plan: DrafterPlan, runtime: str) -> None:
    """Before any load: a checkpoint's kind runs in drafter runtime `runtime`."""
    kind = plan.checkpoint.kind if plan.checkpoint is not None else None
    if kind is not None and runtime not in kind.runtimes:
        how = " (--verifier mlx --drafter-runtime mlx)" if kind.runtimes == ("mlx",) else ""
        raise ValueError(
            f"drafter {plan.spec.base.text!r} ({kind.name}) runs in {list(kind.runtimes)}{how}, not {runtime}"
        )


def load_drafter(
    spec: str | DrafterSpec | DrafterPlan | None,
    *,
    verifier: Verifier,
    block_size: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    min_confidence: float = 0.0,
    runtime: str = "torch",
    corpus: str | os.PathLike[str] | None = None,
    corpus_cut: float = 0.4,
    costs: Any = None,
) -> Drafter | None:
    """The drafter `spec` names (`specdec.drafting.spec`; a `DrafterPlan` from `check_drafter` is not read
    again), bound to `verifier`; None for "none". `block_size` None: the drafter's own (16 for prompt
    lookup, 5 for a draft model). A "+lookup" spec drafts by prompt lookup where the text repeats and with
    the drafter elsewhere (`LookupFirstDrafter`), by the n-grams of `corpus` (a folder of this verifier's
    own answers, e.g. `bundled_corpus(model)`) where lookup has nothing, cut at running share `corpus_cut`.
    `min_confidence` cuts block drafts where the drafter's running top-1 probability falls below it;
    `costs` (`specdec.costs.VerifyCosts`) instead cuts every draft where it commits the most tokens per
    verify cost. `runtime` "mlx" runs the drafter in MLX beside an MLX verifier (nothing crosses to
    torch); "torch" (default) on `device`."""
    from specdec.drafting.policy import DraftPolicy

    if runtime not in DRAFTER_RUNTIMES:
        raise ValueError(f"unknown drafter runtime {runtime!r}; choose one of {DRAFTER_RUNTIMES}")
    policy = DraftPolicy(min_confidence=min_confidence, corpus_cut=corpus_cut, costs=costs)  # checked here
    plan = check_drafter(spec)
    spec = plan.spec
    if corpus is not None:
        from specdec.drafting.ngrams import check_corpus

        check_corpus(corpus, drafter=spec.text)  # before the drafter loads
    check_device_dtype(device, torch_dtype(dtype))
    if (min_confidence or costs) and spec.base.kind in ("none", "prompt-lookup"):
        what = "min_confidence cuts" if min_confidence else "verify costs cut"
        raise ValueError(f"{what} block drafts; drafter {spec.text!r} has none")
    if spec.autoregressive:
        return None
    inner = _load_base(plan, verifier=verifier, block_size=block_size, device=device, dtype=dtype,
                       runtime=runtime, policy=policy)  # fmt: skip
    if not spec.lookup:
        return inner
    from specdec.drafting.mix import LookupFirstDrafter
    from specdec.drafting.ngrams import load_corpus_ngrams

    ngrams = load_corpus_ngrams(corpus, verifier) if corpus is not None else None
    return LookupFirstDrafter(inner, block_size=block_size or LOOKUP_BLOCK_SIZE, corpus=ngrams, policy=policy)


def _load_base(
    plan: DrafterPlan, *, verifier: Verifier, block_size: int | None, device: str, dtype: str, runtime: str,
    policy: Any,
) -> Drafter:  # fmt: skip
    """The drafter of `plan` without its "+lookup", bound to `verifier`."""
    spec = plan.spec.base
    if spec.kind == "model":
        from specdec.drafting.model import MODEL_BLOCK_SIZE, load_draft_model

        drafter: Drafter = load_draft_model(
            spec.source, verifier=verifier, runtime=runtime, device=device, policy=policy,
            dtype=str(torch_dtype(dtype)).removeprefix("torch."), block_size=block_size or MODEL_BLOCK_SIZE,
        )  # fmt: skip
    elif spec.kind == "mtp":  # the layers live in the verifier's runtime: the drafter runs there
        if verifier.runtime == "mlx":
            from specdec.drafting.mtp_mlx import MLXMtpDrafter

            drafter = MLXMtpDrafter(verifier, policy=policy, block_size=block_size)
        else:
            from specdec.drafting.mtp import MtpDrafter

            drafter = MtpDrafter.for_verifier(verifier, policy=policy, block_size=block_size)
    elif spec.kind == "prompt-lookup":
        from specdec.drafting.lookup import PromptLookupDrafter

        drafter = PromptLookupDrafter(block_size=block_size or LOOKUP_BLOCK_SIZE)
    else:
        ckpt = plan.checkpoint
        assert ckpt is not None
        check_kind_runtime(plan, runtime)
        drafter = ckpt.kind.load(
            ckpt,
            runtime=runtime,
            device=device,
            dtype=torch_dtype(dtype),
            policy=policy,
            block_size=block_size,
        )
    drafter.bind(verifier)
    return drafter
