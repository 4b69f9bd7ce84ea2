"""From a `--drafter` value to a bound drafter: checked whole before anything loads, then loaded from what
the check read (a checkpoint's header is read once per run), through the registry's table only.

    plan = check_drafter("bundled:smollm2-135m+lookup")      # spec, kind, checkpoint config and header
    check_drafter_fits(plan, model_shape("hf", "smollm2-135m"))   # against the model, before it loads
    drafter = load_drafter(plan, verifier=v, ...)             # the weights, once, and bind
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.drafting.registry import DrafterPlan, DrafterSpec, plan
from specdec.dtypes import check_device_dtype, torch_dtype
from specdec.protocols import Drafter, Verifier

__all__ = [
    "DRAFTER_RUNTIMES", "DrafterPlan", "check_corpus_for", "check_drafter", "check_drafter_fits",
    "check_drafter_runtimes", "check_kind_runtime", "check_plan", "load_drafter",
]  # fmt: skip

DRAFTER_RUNTIMES = ("torch", "mlx")


#: a drafter spec checked before any model loads (`registry.plan`): its grammar, its kind, a checkpoint's
#: format, config and weights header (a hub repo id is fetched into its cache), a draft model's name.
#: The API's edge: everything after it takes the plan.
check_drafter = plan


def check_plan(
    plan: DrafterPlan,
    *,
    runtime: str,
    target: Any = None,
    target_folder: Path | None = None,
    corpus: str | os.PathLike[str] | None = None,
) -> None:
    """Everything about a planned drafter that can be known before a model loads, in one place: its kind
    runs in drafter runtime `runtime`, fits the verifier's model as far as it is known
    (`check_drafter_fits`), and a `corpus` goes with its "+lookup" (`check_corpus_for`)."""
    if corpus is not None:
        check_corpus_for(plan, corpus, target=target)
    check_kind_runtime(plan, runtime)
    check_drafter_fits(plan, target, target_folder=target_folder)


def check_drafter_fits(plan: DrafterPlan, target: Any, *, target_folder: Path | None = None) -> None:
    """A checked drafter against the verifier's model as far as it is known (`target`: a verifier, or
    `specdec.models.model_shape` before it loads; None: nothing to check yet), by its kind's `fits`
    (target layers, hidden size, vocabulary, with the offending values; a draft model's tokenizer where
    both folders are on disk, `target_folder`)."""
    if target is not None and plan.kind.fits is not None:
        plan.kind.fits(plan.header, target, plan.spec.base.text, target_folder)


def check_corpus_for(plan: DrafterPlan, corpus: str | os.PathLike[str], *, target: Any = None) -> None:
    """Before any load: a corpus drafts behind "+lookup" only, and must be one `target` wrote."""
    from specdec.drafting.lookup.ngrams import check_corpus

    if not plan.spec.lookup:
        raise ValueError(
            f"a corpus drafts where lookup has nothing: give a '+lookup' drafter, not {plan.spec.text!r}"
        )
    check_corpus(corpus, target=target)


def check_drafter_runtimes(verifier: str, runtimes: Sequence[str]) -> None:
    """Before any load: a drafter in MLX reads the verifier's features as MLX arrays."""
    if "mlx" in runtimes and verifier != "mlx":
        raise ValueError("drafter runtime mlx needs --verifier mlx (its features stay MLX arrays)")


def check_kind_runtime(plan: DrafterPlan, runtime: str) -> None:
    """Before any load: the drafter's kind runs in drafter runtime `runtime`."""
    kind = plan.kind
    if runtime not in kind.runtimes:
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
    """The drafter `spec` names (a `--drafter` value, or the `DrafterPlan` `check_drafter` made, not read
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
    plan = spec if isinstance(spec, DrafterPlan) else check_drafter(spec)
    if corpus is not None:
        check_corpus_for(plan, corpus)  # before the drafter loads
    check_device_dtype(device, torch_dtype(dtype))
    if (min_confidence or costs) and not plan.kind.cuts:
        what = "min_confidence cuts" if min_confidence else "verify costs cut"
        raise ValueError(f"{what} block drafts; drafter {plan.spec.text!r} has none")
    check_kind_runtime(plan, runtime)
    dt = torch_dtype(dtype)
    drafter = plan.kind.load(
        plan,
        verifier=verifier,
        runtime=runtime,
        device=device,
        dtype=dt,
        policy=policy,
        block_size=block_size,
    )
    if drafter is None:
        return None
    drafter.bind(verifier)
    if not plan.spec.lookup:
        return drafter
    from specdec.drafting.lookup.ngrams import load_corpus_ngrams
    from specdec.drafting.mix import LookupFirstDrafter

    ngrams = load_corpus_ngrams(corpus, verifier) if corpus is not None else None
    return LookupFirstDrafter(drafter, block_size=block_size, corpus=ngrams, policy=policy)
