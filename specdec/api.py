"""The user-facing Python API: load a verifier and a drafter by name, run prompts, write results.

from specdec.api import load_verifier, load_drafter, run
v = load_verifier("stub")
result = run(v, ["Hello"], drafter=load_drafter("prompt-lookup", verifier=v), out="result.json")
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.bundled import bundled_corpus, bundled_drafter
from specdec.chat import encode_prompt
from specdec.costs import VerifyCosts, choose_block, measure_tree_costs
from specdec.drafting.lookup import LOOKUP_BLOCK_SIZE
from specdec.engine import DecodeConfig, check_request, generate
from specdec.kernels import MAX_VERIFY_TOKENS
from specdec.protocols import Describes, Drafter, TreeVerify, Verifier
from specdec.records import (
    JsonlWriter,
    PromptResult,
    atomic_write_json,
    check_output_path,
    run_json,
    steps_path,
    summarize,
)
from specdec.tree import TREE_AUTO_NODES, TreeBudget

__all__ = [
    "DRAFTER_RUNTIMES", "LOOKUP_BLOCK_SIZE", "RUNTIMES", "Loaded", "RunSpec", "bundled_corpus",
    "bundled_drafter", "check_device_dtype", "check_drafter", "check_drafter_fits", "check_drafter_runtimes",
    "check_model", "drafter_for", "encode_prompt", "load", "load_drafter", "load_verifier",
    "load_verifier_auto", "resolve_dtype", "run", "run_config", "torch_dtype",
]  # fmt: skip

RUNTIMES = ("stub", "hf", "mlx")  # verifier runtimes
DRAFTER_RUNTIMES = ("torch", "mlx")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def _check_choice(what: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choose one of {choices}")


def _check_stub_model(runtime: str, model: str | None) -> None:
    if runtime == "stub" and model is not None:
        raise ValueError(f"the stub verifier has a model of its own; --model {model!r} is for hf / mlx")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def resolve_dtype(name: str, runtime: str, device: str = "cpu") -> tuple[str, str]:
    """("float32" | "bfloat16" | ..., why) for a dtype name, before the model loads; "auto" picks bf16 for a
    torch verifier on a CPU with AMX or avx512_bf16 (native bf16 matmuls: faster end to end, see
    docs/dtype.md), fp32 everywhere else. Whether bf16 is also exact is a property of the loaded model:
    `load_verifier_auto` checks it and falls back to fp32."""
    if name != "auto":
        torch_dtype(name)
        return name, "asked for"
    if runtime not in ("hf", "stub") or torch.device(device).type != "cpu":
        return (
            "float32",
            f"{runtime} on {device}: the exact dtype everywhere (no batch-invariant bf16 verify here)",
        )
    units = [n for n, has in (("AMX", torch.cpu._is_amx_tile_supported()),
                              ("avx512_bf16", torch.cpu._is_avx512_bf16_supported())) if has]  # fmt: skip
    if not units:
        return (
            "float32",
            "this CPU has neither AMX nor avx512_bf16: bf16 matmuls are emulated, slower than fp32",
        )
    return "bfloat16", (
        f"this CPU has {' and '.join(units)} (native bf16 matmuls; measured on an avx512_bf16 EPYC, bf16 "
        "decodes 1.05-1.42x faster than fp32: docs/dtype.md)"
    )


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


def check_device_dtype(device: str | torch.device, dtype: torch.dtype | None = None) -> None:
    """ValueError for a device this torch cannot use (a CUDA device without CUDA, MPS off a Mac, a name
    torch does not know) or a device / dtype pair the platform cannot run (bf16 on MPS needs macOS 14)."""
    import platform

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r}: {e}") from None
    usable = {
        "cpu": lambda: True,
        "cuda": lambda: torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count(),
        "mps": lambda: torch.backends.mps.is_available(),
    }
    if dev.type not in usable:
        raise ValueError(f"device {device!r}: specdec runs on cpu, cuda or mps")
    if not usable[dev.type]():
        build = f"torch {torch.__version__}" + (
            "" if torch.version.cuda or dev.type != "cuda" else ", no CUDA build"
        )
        raise ValueError(f"device {device!r} is not available here ({build}); use --device cpu")
    if dev.type == "mps" and dtype == torch.bfloat16:
        version = platform.mac_ver()[0]
        if version and int(version.split(".")[0]) < 14:
            raise ValueError(
                f"bfloat16 on MPS needs macOS 14 or later (this is macOS {version}); use --dtype float16 or "
                "float32 for the drafter"
            )


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


def check_drafter(spec: str | None) -> Path | None:
    """Check a drafter spec before any model loads: a DFlash checkpoint's config and weights header (names,
    shapes, truncation; a hub repo id is fetched into its cache), a draft model's name. Its checkpoint
    folder, or None for "none" / "prompt-lookup" / a draft model."""
    if spec in (None, "none", "prompt-lookup"):
        return None
    if spec.startswith("model:") and not spec.endswith("+lookup"):
        from specdec.drafting.model import check_draft_model

        check_draft_model(spec.removeprefix("model:"))
        return None
    if spec.endswith("+lookup"):
        if spec.removesuffix("+lookup") in ("none", "prompt-lookup"):
            raise ValueError(f"drafter {spec!r}: '+lookup' goes after a DFlash drafter")
        return check_drafter(spec.removesuffix("+lookup"))
    if spec.startswith("bundled:"):
        path = bundled_drafter(spec.removeprefix("bundled:"))
    else:
        from specdec.models import resolve_drafter

        path = resolve_drafter(spec)  # a local folder as it is; a hub repo id from the hub cache
    if not (path / "config.json").is_file():
        raise ValueError(
            f"drafter {spec!r}: expected 'none', 'prompt-lookup', 'model:<draft model>' or a DFlash "
            "checkpoint folder"
        )
    from specdec.drafting.checkpoint import check_checkpoint
    from specdec.drafting.formats import refuse_as_drafter
    from specdec.models import read_config

    raw = read_config(path)
    if raw is not None:  # an EAGLE-3, MTP, ... folder is named as what it is, not diagnosed as broken DFlash
        refuse_as_drafter(path, raw, name=spec)
    check_checkpoint(path)
    return path


def check_model(runtime: str, model: str | None) -> None:
    """Before it loads: a local model folder that holds a drafter, not a model, is refused in one line."""
    from specdec.drafting.formats import refuse_as_model
    from specdec.models import read_config

    raw = read_config(Path(model).expanduser()) if runtime != "stub" and model else None
    if raw is not None:
        refuse_as_model(model, raw)


def check_drafter_fits(spec: str | None, model: str | None, *, runtime: str = "hf") -> None:
    """Before either loads: a DFlash drafter or a draft model against the verifier's model as far as it is
    known then (`model_shape`): a DFlash drafter's target layers, hidden size and vocabulary, with the
    offending values (`checkpoint.check_target`, as `bind` checks the verifier); a draft model's vocabulary
    and, where both are on disk, its tokenizer (`drafting.model.check_draft_model_fits`)."""
    from specdec.drafting.checkpoint import check_target, load_config
    from specdec.models import local_folder, model_shape

    path = check_drafter(spec)
    target = model_shape(runtime, model)
    base = (spec or "").removesuffix("+lookup")
    if target is not None and base.startswith("model:"):
        from specdec.drafting.model import check_draft_model_fits

        folder = local_folder(model) if runtime != "stub" else None
        check_draft_model_fits(base.removeprefix("model:"), target, folder=folder)
    if path is not None and target is not None:
        check_target(load_config(path), target, name=str(spec))


def load_drafter(
    spec: str | None,
    *,
    verifier: Verifier,
    block_size: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    min_confidence: float = 0.0,
    runtime: str = "torch",
    corpus: str | os.PathLike[str] | None = None,
    corpus_cut: float = 0.4,
    costs: VerifyCosts | None = None,
) -> Drafter | None:
    """`spec`: None/"none" (autoregressive), "prompt-lookup", "bundled:<model>" (a drafter shipped with
    specdec, e.g. "bundled:smollm2-135m"), a folder with a DFlash checkpoint, or a hub repo id of one
    (`owner/name`: config.json and *.safetensors only, cached; see `specdec.models.resolve_drafter`), or
    "model:<folder | known name | hub id>": a small causal LM of the verifier's tokenizer drafting token by
    token (`specdec.drafting.model`; in transformers, or in mlx_lm with `runtime` "mlx"). `block_size`
    None: the drafter's own (16 for prompt lookup, 5 for a draft model). A DFlash or draft-model spec ending
    in "+lookup" drafts by prompt lookup where the text repeats and with that drafter elsewhere
    (`LookupFirstDrafter`). `min_confidence` cuts DFlash blocks where the drafter's running top-1
    probability falls below it (worth it where verifying several tokens costs much more than one).
    `runtime` "mlx" runs a DFlash drafter in MLX itself (`specdec.drafting.dflash_mlx`, with an MLX verifier:
    nothing crosses to torch); "torch" (default) the PyTorch drafter on `device`. `corpus`, a corpus
    folder of this verifier's own answers (e.g. `bundled_corpus(model)`), makes a "+lookup" drafter try
    their n-grams where lookup has nothing, cut at running share `corpus_cut` (`LookupFirstDrafter`).
    `costs` (`specdec.costs.VerifyCosts`, instead of `min_confidence`) cuts every draft where it commits
    the most tokens per verify cost; a "+lookup" drafter then picks the better of lookup and corpus."""
    from specdec.drafting.policy import DraftPolicy

    _check_choice("drafter runtime", runtime, DRAFTER_RUNTIMES)
    policy = DraftPolicy(min_confidence=min_confidence, corpus_cut=corpus_cut, costs=costs)  # checked here
    if corpus is not None:
        from specdec.drafting.ngrams import check_corpus

        check_corpus(corpus, drafter=str(spec))  # before the drafter loads
    check_device_dtype(device, torch_dtype(dtype))
    if (min_confidence or costs) and (
        spec in (None, "none") or spec.removesuffix("+lookup") == "prompt-lookup"
    ):
        what = "min_confidence cuts" if min_confidence else "verify costs cut"
        raise ValueError(f"{what} DFlash blocks; drafter {spec!r} has none")
    if spec in (None, "none"):
        return None
    if spec.endswith("+lookup"):
        from specdec.drafting.mix import LookupFirstDrafter
        from specdec.drafting.ngrams import load_corpus_ngrams

        inner = load_drafter(
            spec.removesuffix("+lookup"), verifier=verifier, block_size=block_size, device=device,
            dtype=dtype, min_confidence=min_confidence, runtime=runtime, costs=costs,
        )  # fmt: skip
        if inner is None or inner.name == "prompt-lookup":
            raise ValueError(f"drafter {spec!r}: '+lookup' goes after a DFlash drafter or a draft model")
        ngrams = load_corpus_ngrams(corpus, verifier) if corpus is not None else None
        lookup_block = block_size or LOOKUP_BLOCK_SIZE
        return LookupFirstDrafter(inner, block_size=lookup_block, corpus=ngrams, policy=policy)
    path = check_drafter(spec)
    if spec.startswith("model:"):
        from specdec.drafting.model import MODEL_BLOCK_SIZE, load_draft_model

        drafter: Drafter = load_draft_model(
            spec.removeprefix("model:"), verifier=verifier, runtime=runtime, device=device, policy=policy,
            dtype=str(torch_dtype(dtype)).removeprefix("torch."), block_size=block_size or MODEL_BLOCK_SIZE,
        )  # fmt: skip
    elif path is None:
        from specdec.drafting.lookup import PromptLookupDrafter

        drafter = PromptLookupDrafter(block_size=block_size or LOOKUP_BLOCK_SIZE)
    else:
        drafter = _dflash_drafter(spec, path, runtime=runtime, device=device, dtype=dtype, policy=policy)
    drafter.bind(verifier)
    return drafter


def _dflash_drafter(spec: str, path: Path, *, runtime: str, device: str, dtype: str, policy: Any) -> Drafter:
    """The DFlash checkpoint at `path` in drafter runtime `runtime`, named as `spec` names it."""
    if runtime == "mlx":
        from specdec.drafting.dflash_mlx import MLXDFlashDrafter

        name = str(torch_dtype(dtype)).removeprefix("torch.")  # "bf16" -> "bfloat16"
        drafter: Drafter = MLXDFlashDrafter.from_pretrained(path, dtype=name, policy=policy)
    else:
        from specdec.drafting.dflash import DFlashDrafter

        drafter = DFlashDrafter.from_pretrained(path, device=device, dtype=torch_dtype(dtype), policy=policy)
    if spec.startswith("bundled:"):
        drafter.name = f"{spec.removeprefix('bundled:')}-dflash"
    elif str(path) != spec:
        drafter.name = spec  # a hub repo id names the drafter, not its cache folder
    return drafter


def check_drafter_runtimes(verifier: str, runtimes: Sequence[str]) -> None:
    """Before any load: a drafter in MLX reads the verifier's features as MLX arrays."""
    if "mlx" in runtimes and verifier != "mlx":
        raise ValueError("drafter runtime mlx needs --verifier mlx (its features stay MLX arrays)")


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

    def check(self) -> dict[str, Any] | None:
        """One-line ValueErrors for anything wrong that can be known before a model loads; the `costs`
        table, read (None: none given)."""
        from specdec.drafting.policy import DraftPolicy

        _check_choice("verifier runtime", self.verifier, RUNTIMES)
        _check_choice("drafter runtime", self.drafter_runtime, DRAFTER_RUNTIMES)
        _check_stub_model(self.verifier, self.model)
        check_drafter_runtimes(self.verifier, [self.drafter_runtime])
        dtype = None if self.dtype == "auto" else torch_dtype(self.dtype)
        for device in {self.device, self.verifier_device or self.device}:
            check_device_dtype(device, dtype)
        table = self._cost_table()
        DraftPolicy(min_confidence=self.fixed_confidence, corpus_cut=self.corpus_cut)  # their ranges
        check_model(self.verifier, self.model)
        if self.corpus is not None:
            from specdec.drafting.ngrams import check_corpus
            from specdec.models import model_shape

            check_corpus(self.corpus, drafter=self.drafter, target=model_shape(self.verifier, self.model))
        check_drafter_fits(self.drafter, self.model, runtime=self.verifier)
        if self.tree is not None:
            self._check_tree()
        return table

    def _check_tree(self) -> None:
        if not (self.tree == "auto" or (isinstance(self.tree, int) and 2 <= self.tree <= MAX_VERIFY_TOKENS)):
            raise ValueError(f"--tree takes a node count 2..{MAX_VERIFY_TOKENS} or auto, got {self.tree!r}")
        base = self.drafter.removesuffix("+lookup")
        if base in ("none", "prompt-lookup") or base.startswith("model:"):
            raise ValueError(f"--tree needs a DFlash drafter (optionally +lookup), not {self.drafter!r}")

    def _cost_table(self) -> dict[str, Any] | None:
        if not (self.auto_block or self.auto_cut or self.auto_tree):
            if self.costs:
                raise ValueError(
                    "--costs is read only with --block-size auto, --min-confidence auto or --tree auto"
                )
            return None
        base = self.drafter.removesuffix("+lookup")
        if base == "none" or (self.auto_cut and base == "prompt-lookup"):
            raise ValueError(f"auto block size / confidence cut need a DFlash drafter, not {self.drafter!r}")
        if not self.costs:
            return None
        try:
            table = json.loads(Path(self.costs).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--costs {self.costs!r}: cannot read a JSON cost table ({e})") from None
        VerifyCosts.from_table(table, source=self.costs)  # a malformed table fails here, before any load
        return table


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


def _log(line: str) -> None:
    print(line, file=sys.stderr)


def load(spec: RunSpec, *, log: Callable[[str], None] = _log) -> Loaded:
    """Check `spec` whole, then load what it names; what was chosen on the way (dtype, verify costs, an
    auto block size) is said through `log` (stderr by default)."""
    table = spec.check()
    verifier, dtype, why = load_verifier_auto(
        spec.verifier, spec.model, dtype=spec.dtype, device=spec.verifier_device or spec.device
    )
    log(f"dtype {dtype} ({why})")
    costs = None
    if spec.auto_block or spec.auto_cut:
        costs = VerifyCosts.from_table(table, source=spec.costs) if table else VerifyCosts.measure(verifier)
    cut_costs = costs if spec.auto_cut else None
    drafter = drafter_for(spec, verifier, dtype=dtype, costs=cut_costs)
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
    spec: RunSpec, verifier: Verifier, *, dtype: str, costs: VerifyCosts | None, runtime: str | None = None
) -> Drafter | None:
    """The drafter `spec` names, bound to `verifier`, in `dtype`, its drafts cut by `costs` where given (else
    by `spec.min_confidence`), in drafter runtime `runtime` (default `spec.drafter_runtime`)."""
    return load_drafter(
        spec.drafter, verifier=verifier, block_size=spec.fixed_block, device=spec.device,
        dtype=dtype, min_confidence=spec.fixed_confidence, runtime=runtime or spec.drafter_runtime,
        corpus=spec.corpus, corpus_cut=spec.corpus_cut, costs=costs,
    )  # fmt: skip


def run_config(
    verifier: Verifier, drafter: Drafter | None, cfg: DecodeConfig, **extra: Any
) -> dict[str, Any]:
    return {
        "verifier": {
            "runtime": verifier.runtime,
            "model": verifier.model_name,
            "dtype": verifier.dtype,
            # a verify of several tokens equals one-token steps bit for bit (see specdec.kernels)
            "batch_invariant": verifier.batch_invariant,
        },
        "drafter": None
        if drafter is None
        else {
            "name": drafter.name,
            "runtime": drafter.runtime,
            "block_size": drafter.block_size,
            "target_layer_ids": list(drafter.target_layer_ids),
            # where it was loaded from, how its drafts are cut, which corpus, proposals by source: what
            # the drafter says of itself (`specdec.protocols.Describes`), None where it has none of these
            **dict.fromkeys(("path", "min_confidence", "costs", "corpus", "proposals")),
            **(drafter.describe() if isinstance(drafter, Describes) else {}),
        },
        "block_size": cfg.block_size if drafter is not None else 1,
        "temperature": cfg.sampling.temperature if cfg.sampling else 0.0,
        "seed": cfg.sampling.seed if cfg.sampling else 0,
        "sampling": asdict(cfg.sampling) if cfg.sampling else None,
        "max_new_tokens": cfg.max_new_tokens,
        "decode": {
            k: (sorted(v) if isinstance(v, frozenset) else v)
            for k, v in asdict(cfg).items()
            if k != "sampling"
        },
        **extra,
    }


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
    results: list[PromptResult] = []
    try:
        from tqdm import tqdm

        bar = tqdm(
            total=len(encoded), desc="prompts", disable=not progress or len(encoded) < 2, file=sys.stderr
        )
        for i, ids in enumerate(encoded):
            results.append(generate(verifier, ids, drafter=drafter, cfg=cfg, prompt_id=str(i), jsonl=jsonl))
            tau = summarize(results)["acceptance_length_mean"]
            bar.set_postfix(tau=f"{tau:.2f}" if tau else "-")
            bar.update()
        bar.close()
    finally:
        if jsonl:
            jsonl.close()
    device = str(drafter.device) if drafter is not None else "cpu"
    result = run_json(
        config=run_config(verifier, drafter, cfg, **(config_extra or {})), results=results, device=device
    )
    if out_path:
        assert jsonl is not None
        atomic_write_json(out_path, result, before_rename=jsonl.commit)
    return result
