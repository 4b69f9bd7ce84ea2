"""The user-facing Python API: load a verifier and a drafter by name, run prompts, write results.

from specdec.api import load_verifier, load_drafter, run
v = load_verifier("stub")
result = run(v, ["Hello"], drafter=load_drafter("prompt-lookup", verifier=v), out="result.json")
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.bundled import bundled_corpus, bundled_drafter
from specdec.chat import encode_prompt
from specdec.costs import VerifyCosts, choose_block, measure_tree_costs
from specdec.drafting.load import (
    DRAFTER_RUNTIMES,
    DrafterPlan,
    check_drafter,
    check_drafter_fits,
    check_drafter_runtimes,
    check_plan,
    load_drafter,
)
from specdec.drafting.lookup.prompt import LOOKUP_BLOCK_SIZE
from specdec.drafting.registry import DrafterSpec
from specdec.dtypes import check_device_dtype, resolve_dtype, torch_dtype
from specdec.engine import DecodeConfig, check_request, decode_config, generate
from specdec.extras import require
from specdec.kernels import MAX_VERIFY_TOKENS
from specdec.processors import LogitsParams
from specdec.protocols import Drafter, TreeVerify, Verifier
from specdec.records import (
    JsonlWriter,
    PromptResult,
    atomic_write_json,
    check_output_path,
    run_config,
    run_json,
    steps_path,
    summarize,
)
from specdec.sampling import SamplingParams
from specdec.threads import choice_for
from specdec.tree import TREE_AUTO_NODES, TreeBudget

__all__ = [
    "DRAFTER_RUNTIMES", "LOOKUP_BLOCK_SIZE", "RUNTIMES", "Checked", "Loaded", "RunSpec", "bundled_corpus",
    "bundled_drafter", "check_device_dtype", "check_drafter", "check_drafter_fits", "check_drafter_runtimes",
    "check_model", "drafter_for", "encode_prompt", "load", "load_drafter", "load_verifier",
    "load_verifier_auto", "resolve_dtype", "run", "run_config", "torch_dtype",
]  # fmt: skip

RUNTIMES = ("stub", "hf", "mlx")  # verifier runtimes


def _check_choice(what: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choose one of {choices}")


def _check_stub_model(runtime: str, model: str | None) -> None:
    if runtime == "stub" and model is not None:
        raise ValueError(f"the stub verifier has a model of its own; --model {model!r} is for hf / mlx")


def load_verifier_auto(
    runtime: str, model: str | None = None, *, dtype: str = "auto", device: str = "cpu"
) -> tuple[Verifier, str, str]:
    """`load_verifier` with the dtype name resolved (`resolve_dtype`): (verifier, its dtype, why). Where
    "auto" chose a half precision whose verify of the loaded model is not batch-invariant here (measured
    at load: speculation would not be exact), the model is loaded again in fp32."""
    name, why = resolve_dtype(dtype, runtime, device)
    verifier = load_verifier(runtime, model, dtype=name, device=device)
    if dtype == "auto" and name != "float32" and not verifier.batch_invariant:
        del verifier
        why = f"a {name} verify of this model is not batch-invariant here (measured at load): not exact"
        name, verifier = "float32", load_verifier(runtime, model, dtype="float32", device=device)
    elif dtype == "auto" and name != "float32":
        why += "; this model's verify equals one-token steps bit for bit here (measured at load): exact"
    return verifier, name, why


def load_verifier(
    runtime: str, model: str | None = None, *, dtype: str = "float32", device: str = "cpu"
) -> Verifier:
    """`runtime` is "stub", "hf" or "mlx"; `model` a short name (smollm2-135m, gemma3-270m), a local HF
    folder, or (mlx) an mlx-community repo id."""
    _check_choice("verifier runtime", runtime, RUNTIMES)
    _check_stub_model(runtime, model)
    if runtime == "stub":
        from specdec.verifiers.stub import StubVerifier

        return StubVerifier(dtype=torch_dtype(dtype))
    if model is None:
        raise ValueError(f"--model is required for the {runtime!r} verifier")
    if runtime == "hf":
        from specdec.models import resolve_model
        from specdec.verifiers.hf import HFVerifier

        check_device_dtype(device, torch_dtype(dtype))
        return HFVerifier(resolve_model(model), dtype=torch_dtype(dtype), device=device)
    from specdec.models import resolve_model  # runtime "mlx"
    from specdec.verifiers.mlx import MLXVerifier

    return MLXVerifier(resolve_model(model), dtype=dtype)


def check_model(runtime: str, model: str | None) -> None:
    """Before it loads: a local model folder that holds a drafter, not a model, is refused in one line."""
    from specdec.drafting.registry import refuse_as_model
    from specdec.models import read_config

    raw = read_config(Path(model).expanduser()) if runtime != "stub" and model else None
    if raw is not None:
        refuse_as_model(model, raw)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What a run loads, as the command line gives it (`specdec.args.run_spec`) or a program builds it.
    `check()` tests every field before anything loads; `load` builds the models from it.

    `device` is the drafter's, and an HF verifier's unless `verifier_device` is given. `block_size` None
    means the drafter's own, "auto" the largest whose rows are cheap to verify (`choose_block`);
    `min_confidence` "auto" cuts every draft by verify cost. Both auto options read the `bench-verify`
    table at `costs`, or time the verifier at load without one."""

    verifier: str = "stub"
    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    verifier_device: str | None = None
    drafter: str = "prompt-lookup"
    drafter_runtime: str = "torch"
    block_size: int | str | None = None
    min_confidence: float | str = 0.0
    costs: str | None = None
    corpus: str | None = None
    corpus_cut: float = 0.4
    tree: int | str | None = None  # nodes per tree step (`--tree`), "auto", or None: chains

    @property
    def auto_block(self) -> bool:
        return self.block_size == "auto"

    @property
    def auto_cut(self) -> bool:
        return self.min_confidence == "auto"

    @property
    def auto_tree(self) -> bool:
        return self.tree == "auto"

    @property
    def fixed_confidence(self) -> float:
        """`min_confidence` as a number (0 when auto: the verify costs cut instead)."""
        return 0.0 if self.auto_cut else float(self.min_confidence)

    @property
    def fixed_block(self) -> int | None:
        """`block_size` as given (None: the drafter's own, or auto)."""
        return self.block_size if isinstance(self.block_size, int) else None

    def check(self) -> Checked:
        """One-line ValueErrors for anything wrong that can be known before a model loads; what the check
        read, for `load` to use (the drafter's checkpoint header, the `costs` table)."""
        from specdec.drafting.policy import DraftPolicy
        from specdec.models import local_folder, model_shape

        _check_choice("verifier runtime", self.verifier, RUNTIMES)
        _check_choice("drafter runtime", self.drafter_runtime, DRAFTER_RUNTIMES)
        _check_stub_model(self.verifier, self.model)
        for runtime in {self.verifier, self.drafter_runtime} & {"hf", "mlx"}:  # a wheel without the extra
            require(f"the {runtime} runtime", runtime)
        check_drafter_runtimes(self.verifier, [self.drafter_runtime])
        dtype = None if self.dtype == "auto" else torch_dtype(self.dtype)
        for device in {self.device, self.verifier_device or self.device}:
            check_device_dtype(device, dtype)
        spec = DrafterSpec.parse(self.drafter)  # once: what follows takes the parsed value
        table = self._cost_table(spec)
        DraftPolicy(min_confidence=self.fixed_confidence, corpus_cut=self.corpus_cut)  # their ranges
        check_model(self.verifier, self.model)
        target = model_shape(self.verifier, self.model)
        plan = check_drafter(spec)
        folder = local_folder(self.model) if self.verifier != "stub" else None
        check_plan(
            plan, runtime=self.drafter_runtime, target=target, target_folder=folder, corpus=self.corpus
        )
        if self.tree is not None:
            self._check_tree(plan)
        return Checked(plan, table)

    def _check_tree(self, plan: DrafterPlan) -> None:
        if not (self.tree == "auto" or (isinstance(self.tree, int) and 2 <= self.tree <= MAX_VERIFY_TOKENS)):
            raise ValueError(f"--tree takes a node count 2..{MAX_VERIFY_TOKENS} or auto, got {self.tree!r}")
        if not plan.trees:
            raise ValueError(
                f"--tree needs a DFlash or EAGLE-3 drafter (optionally +lookup), not {self.drafter!r}"
            )

    def _cost_table(self, spec: DrafterSpec) -> dict[str, Any] | None:
        if not (self.auto_block or self.auto_cut or self.auto_tree):
            if self.costs:
                raise ValueError(
                    "--costs is read only with --block-size auto, --min-confidence auto or --tree auto"
                )
            return None
        if spec.autoregressive or (self.auto_cut and spec.word == "prompt-lookup"):
            raise ValueError(f"auto block size / confidence cut need a DFlash drafter, not {self.drafter!r}")
        if not self.costs:
            return None
        try:
            table = json.loads(Path(self.costs).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--costs {self.costs!r}: cannot read a JSON cost table ({e})") from None
        VerifyCosts.from_table(table, source=self.costs)  # a malformed table fails here, before any load
        model = None if self.verifier == "stub" else self.model
        VerifyCosts.check_measured_on(table, source=self.costs, runtime=self.verifier, model=model)
        return table


@dataclass(frozen=True)
class Checked:
    """What `RunSpec.check` read before anything loads: the drafter (its checkpoint's header included) and
    the `--costs` table (None: none given)."""

    drafter: DrafterPlan
    costs_table: dict[str, Any] | None


@dataclass(frozen=True)
class Loaded:
    """What `load` built: the verifier, the drafter (None: autoregressive), the block size a step drafts
    with, the dtype both run in and why, the verify costs drafts are cut by (None: not by cost), and the
    tree budget of a step (None: chains)."""

    verifier: Verifier
    drafter: Drafter | None
    block_size: int
    dtype: str
    dtype_reason: str
    costs: VerifyCosts | None
    tree: TreeBudget | None = None

    def decode_config(
        self,
        *,
        max_new_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop_token_ids: frozenset[int] | None = None,
        max_context: int | None = None,
        logits: LogitsParams | None = None,
        logprobs: int | None = None,
    ) -> DecodeConfig:
        """A run of what was loaded: its drafter's blocks of `block_size` and its tree budget, or the
        autoregressive baseline where no drafter was loaded (`specdec.engine.decode_config`)."""
        return decode_config(
            self.drafter,
            block_size=self.block_size,
            tree=self.tree,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop_token_ids=stop_token_ids,
            max_context=max_context,
            logits=logits,
            logprobs=logprobs,
        )


def _log(line: str) -> None:
    print(line, file=sys.stderr)


def load(spec: RunSpec, *, log: Callable[[str], None] = _log) -> Loaded:
    """Check `spec` whole, then load what it names; what was chosen on the way (dtype, verify costs, an
    auto block size) is said through `log` (stderr by default)."""
    checked = spec.check()
    table = checked.costs_table
    verifier, dtype, why = load_verifier_auto(
        spec.verifier, spec.model, dtype=spec.dtype, device=spec.verifier_device or spec.device
    )
    log(f"dtype {dtype} ({why})")
    log(f"threads: {choice_for(verifier).describe()}")
    if table:  # its dtype, now that "auto" chose one
        VerifyCosts.check_measured_on(
            table, source=str(spec.costs), runtime=spec.verifier, model=None, dtype=dtype
        )
    costs = None
    if spec.auto_block or spec.auto_cut:
        costs = VerifyCosts.from_table(table, source=spec.costs) if table else VerifyCosts.measure(verifier)
    cut_costs = costs if spec.auto_cut else None
    drafter = drafter_for(spec, verifier, dtype=dtype, costs=cut_costs, plan=checked.drafter)
    block = 1 if drafter is None else spec.fixed_block or drafter.block_size
    if costs is not None and drafter is not None:
        log(costs.summary())
        if spec.auto_block:
            block, why_block = choose_block(costs, max_block=drafter.block_size)
            log(f"block size {block}: {why_block}")
        if spec.auto_cut:
            log("drafts cut where they commit the most tokens per verify cost")
    tree = _tree_budget(spec, verifier, table, log) if drafter is not None else None
    return Loaded(verifier, drafter, block, dtype, why, cut_costs, tree)


def _tree_budget(
    spec: RunSpec, verifier: Verifier, table: dict[str, Any] | None, log: Callable[[str], None]
) -> TreeBudget | None:
    """`--tree N`, or for `--tree auto` up to TREE_AUTO_NODES nodes priced by the `--costs` table (a chain's:
    the best figure there is offline) or, without one, by tree verifies timed here and now."""
    if spec.tree is None:
        return None
    if not spec.auto_tree:
        log(f"trees of up to {spec.tree} nodes")
        return TreeBudget(int(spec.tree))
    if table:
        costs = VerifyCosts.from_table(table, source=spec.costs)
    else:
        if isinstance(verifier, TreeVerify):
            verifier.check_tree()  # before timing trees the model cannot verify
        _, seconds = measure_tree_costs(verifier, sizes=(1, 2, 4, 8, 16, TREE_AUTO_NODES))
        costs = VerifyCosts.from_seconds(seconds, source="measured tree verifies")
    log(costs.summary())
    log(f"trees of up to {TREE_AUTO_NODES} nodes, as many as pay for their verify cost")
    return TreeBudget(TREE_AUTO_NODES, costs=costs)


def drafter_for(
    spec: RunSpec,
    verifier: Verifier,
    *,
    dtype: str,
    costs: VerifyCosts | None,
    runtime: str | None = None,
    plan: DrafterPlan | None = None,
) -> Drafter | None:
    """The drafter `spec` names, bound to `verifier`, in `dtype`, its drafts cut by `costs` where given (else
    by `spec.min_confidence`), in drafter runtime `runtime` (default `spec.drafter_runtime`); `plan`: the
    drafter as `RunSpec.check` read it (else it is read here)."""
    return load_drafter(
        plan or spec.drafter,
        verifier=verifier,
        block_size=spec.fixed_block,
        device=spec.device,
        dtype=dtype,
        min_confidence=spec.fixed_confidence,
        runtime=runtime or spec.drafter_runtime,
        corpus=spec.corpus,
        corpus_cut=spec.corpus_cut,
        costs=costs,
    )


def run(
    verifier: Verifier,
    prompts: Sequence[str | Sequence[int] | list[dict[str, str]]],
    *,
    drafter: Drafter | None = None,
    cfg: DecodeConfig | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
    config_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Decode every prompt; steps stream to `<out>.steps.jsonl` (via a `.tmp` until the run ends), the result
    JSON lands atomically at `out`. Every prompt and the output path are checked before any work."""
    cfg = cfg or DecodeConfig()
    out_path = check_output_path(out) if out is not None else None
    encoded = [encode_prompt(verifier, p) for p in prompts]
    for ids in encoded:
        check_request(verifier, ids, drafter, cfg)
    jsonl = JsonlWriter(steps_path(out_path)) if out_path else None
    with jsonl or contextlib.nullcontext():  # interrupted or failed: its staging file goes too
        from tqdm import tqdm

        bar = tqdm(
            total=len(encoded), desc="prompts", disable=not progress or len(encoded) < 2, file=sys.stderr
        )
        results: list[PromptResult] = []
        for i, ids in enumerate(encoded):
            results.append(generate(verifier, ids, drafter=drafter, cfg=cfg, prompt_id=str(i), jsonl=jsonl))
            tau = summarize(results)["acceptance_length_mean"]
            bar.set_postfix(tau=f"{tau:.2f}" if tau else "-")
            bar.update()
        bar.close()
        device = str(drafter.device) if drafter is not None else "cpu"
        result = run_json(
            config=run_config(verifier, drafter, cfg, **(config_extra or {})), results=results, device=device
        )
        if out_path:
            assert jsonl is not None
            atomic_write_json(out_path, result, before_rename=jsonl.commit)
    return result
