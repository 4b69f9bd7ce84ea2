"""How far a run's `--drafter` value walks through the package before the run has its verifier and
drafter (issue 65's "a spec walks a short way"): `api.load` traced with `sys.setprofile` on the stub
verifier with a random DFlash checkpoint + "+lookup".

A call counts where it carries the spec: the `RunSpec`, the drafter's text, or a `DrafterSpec` /
`DrafterPlan` (`Checkpoint` before Dec 2026) among its arguments. Of those calls:
- hops: calls into another module than the caller's (the walk's stops between modules);
- up: hops into a module that imports the caller's, directly or not (a call back up the import order);
- modules: the modules the spec passes through.

    python -m specdec.evals.spec_walk [--json out.json]

It reads what it traces from the package it imports, so an older checkout can be measured the same way
(the file copied there, run with that checkout first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOTS = (("specdec.bridges", "bridges"), ("specdec.verifiers", "verifiers"), ("specdec", "specdec"))
CARRIERS = ("RunSpec", "DrafterSpec", "DrafterPlan", "Checkpoint")


def _imports_closure(repo: Path) -> dict[str, set[str]]:
    """module -> every package module it imports, directly or not."""
    files = {}
    for pkg, folder in ROOTS:
        for f in (repo / folder).rglob("*.py"):
            parts = [p for p in f.relative_to(repo / folder).with_suffix("").parts if p != "__init__"]
            files.setdefault(".".join([pkg, *parts]), f)
    direct = {}
    for m, f in files.items():
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        direct[m] = {d for d in found if d in files and d != m}
    closure: dict[str, set[str]] = {}

    def reach(m: str) -> set[str]:
        if m not in closure:
            closure[m] = set()
            for d in direct.get(m, ()):
                closure[m] |= {d, *reach(d)}
        return closure[m]

    return {m: reach(m) for m in direct}


def _module_of(filename: str, repo: Path) -> str | None:
    p = Path(filename).resolve()
    for pkg, folder in ROOTS:
        root = (repo / folder).resolve()
        if root in p.parents:
            return ".".join([pkg, *(x for x in p.relative_to(root).with_suffix("").parts if x != "__init__")])
    return None


def _stub_checkpoint(path: Path) -> Path:
    import torch

    try:
        from specdec.drafting.dflash.config import DFlashConfig, save_checkpoint
        from specdec.drafting.dflash.model import DFlashDraftModel
    except ImportError:  # a checkout from before the drafting house
        from specdec.drafting.checkpoint import DFlashConfig, save_checkpoint
        from specdec.drafting.dflash_model import DFlashDraftModel
    cfg = DFlashConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=32, vocab_size=259, num_target_layers=4, mask_token_id=258, block_size=4,
        target_layer_ids=(1, 2),
    )  # fmt: skip
    torch.manual_seed(0)
    return save_checkpoint(path, cfg, DFlashDraftModel(cfg).state_dict())


def walk() -> dict[str, Any]:
    """The traced walk of one `api.load` (module docstring)."""
    import specdec
    from specdec.api import RunSpec, load

    repo = Path(specdec.__file__).resolve().parents[1]
    spec = RunSpec(verifier="stub", drafter=f"{_stub_checkpoint(Path(tempfile.mkdtemp()) / 'd')}+lookup")
    texts = (spec.drafter, spec.drafter.removesuffix("+lookup"))
    calls: list[tuple[str | None, str, str]] = []

    def carries(v: Any) -> bool:
        return type(v).__name__ in CARRIERS or (isinstance(v, str) and v in texts)

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event != "call" or code.co_name.startswith("<"):
            return
        module = _module_of(code.co_filename, repo)
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if module is not None and any(carries(frame.f_locals.get(n)) for n in names):
            caller = _module_of(frame.f_back.f_code.co_filename, repo) if frame.f_back else None
            calls.append((caller, module, code.co_name))

    sys.setprofile(profile)
    try:
        loaded = load(spec, log=lambda _: None)
    finally:
        sys.setprofile(None)
    assert loaded.drafter is not None
    deps = _imports_closure(repo)
    # a call from generated code (a dataclass's __init__: no package file) stays in its class's module
    hops = [c for c in calls[1:] if c[0] is not None and c[0] != c[1]]
    up = [c for c in hops if c[0] in deps.get(c[1], ())]
    return {
        "calls": len(calls), "hops": len(hops), "up": len(up), "modules": len({c[1] for c in calls}),
        "hop_list": [f"{a} -> {b}.{f}" for a, b, f in hops], "up_list": [f"{a} -> {b}.{f}" for a, b, f in up],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the walk (with its hops) here")
    args = ap.parse_args()
    out = walk()
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("_list")}))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
