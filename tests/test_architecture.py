"""The shape of the package, checked: imports point one way (no circle, lazy imports inside functions
included), and runtime code never reaches into `evals` (benchmarks and studies sit on top of it)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: package -> its folder in the repo (bridges/, verifiers/ and evals/ install under specdec)
ROOTS = {
    "specdec": "specdec",
    "specdec.bridges": "bridges",
    "specdec.verifiers": "verifiers",
    "specdec.evals": "evals",
}
#: the tools on top, which may use `evals` (its datasets, its runner): the command line and training
ABOVE_EVALS = ("specdec.cli", "specdec.train", "specdec.evals")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in ROOTS.items():
        for f in (REPO / folder).rglob("*.py"):
            parts = [p for p in f.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports, or None (depth-first search, colouring the modules on the current path)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    graph = _graph()
    assert len(graph) > 40 and graph["specdec.api"]  # the walk found the package and its imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_runtime_code_never_imports_evals():
    bad = {
        m: sorted(n for n in deps if n.startswith("specdec.evals"))
        for m, deps in _graph().items()
        if not m.startswith(ABOVE_EVALS) and any(n.startswith("specdec.evals") for n in deps)
    }
    assert not bad, bad


#: the packages, low to high: a module imports only modules of its own layer or below. The core (the
#: package's own top-level modules) is lowest; the tools on top (API, command line, batching, training,
#: the server, evals) highest. Verifiers sit below drafting and training.
LAYERS = ("core", "specdec.bridges", "specdec.verifiers", "specdec.drafting", "top")
TOP = ("specdec.api", "specdec.args", "specdec.batch", "specdec.cli", "specdec.console", "specdec.__main__",
       "specdec.train", "specdec.serve", "specdec.evals")  # fmt: skip


def _layer(module: str) -> int:
    if module.startswith(TOP):
        return LAYERS.index("top")
    return next((i for i, p in enumerate(LAYERS) if module == p or module.startswith(p + ".")), 0)


def test_packages_import_downward():
    graph = _graph()
    up = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if _layer(d) > _layer(m))
    assert {_layer(m) for m in graph} == set(range(len(LAYERS))), "a layer matched no module"
    assert not up, up


def _kind_folder(module: str) -> str | None:
    """The drafter kind's folder a module of `specdec.drafting` lives in, or None (the shared top)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["specdec", "drafting"] else None


REGISTRY = "specdec.drafting.registry"
LOOKUP_MIX = ("specdec.drafting.mix", "specdec.drafting.load")  # "+lookup": lookup before any kind


def test_drafter_kinds_stay_in_their_folders():
    """A kind's folder imports no other kind's, and the shared machinery at drafting's top reaches a kind
    only through the registry's table (and the "+lookup" mix, which is lookup's)."""
    graph = _graph()
    kinds = {k for m in graph if (k := _kind_folder(m))}
    assert {"dflash", "eagle3", "mtp", "lookup"} <= kinds, kinds
    bad = []
    for m, deps in graph.items():
        if not m.startswith("specdec.drafting."):
            continue
        own = _kind_folder(m)
        for d in deps:
            other = _kind_folder(d)
            if other is None or other == own:
                continue
            if own is None and (m == REGISTRY or (m in LOOKUP_MIX and other == "lookup")):
                continue
            bad.append(f"{m} -> {d}")
    assert not bad, sorted(bad)


#: the runtime's folders, measured as the formatter writes them (CI runs `ruff format --check`): functions
#: of at most MAX_LINES lines, modules under MAX_MODULE_LINES, and `# fmt: skip` (which would let code be
#: packed to fit) only where a table reads better, at most MAX_FMT_SKIPS of them
MAX_LINES, MAX_MODULE_LINES, MAX_FMT_SKIPS = 80, 600, 40
RUNTIME_FOLDERS = ("specdec", "verifiers", "bridges")


def _runtime_files() -> list[Path]:
    """The runtime's modules, checked to be the ones the package has (a walk that found nothing, or
    missed a folder, would pass every size check)."""
    files = [f for folder in RUNTIME_FOLDERS for f in sorted((REPO / folder).rglob("*.py"))]
    found = {f.relative_to(REPO).as_posix() for f in files}
    assert len(files) > 60 and {"specdec/engine.py", "verifiers/hf.py", "bridges/mlx.py"} <= found, found
    return files


def test_runtime_functions_fit_a_screen():
    long, functions = [], 0
    for f in _runtime_files():
        lines = f.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            n = node.end_lineno - node.lineno + 1
            functions += 1
            if n > MAX_LINES:
                long.append(f"{f.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert functions > 500, functions  # the walk saw the package's functions
    assert not long, long


def test_runtime_modules_stay_small():
    big = [
        f"{f.relative_to(REPO)} ({n} lines)"
        for f in _runtime_files()
        if (n := len(f.read_text().splitlines())) >= MAX_MODULE_LINES
    ]
    assert not big, big


#: the first commit made under the rule: from it on, commit subjects fit 72 characters
SUBJECT_RULE_SINCE = "fcdfaa5421da1bbd20b5f0a94607348d95fd295b"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def test_commit_subjects_fit_72_characters():
    """`git log --oneline` stays readable: details go to the commit body. In a shallow clone (CI's may be)
    the commits it holds are checked, all made under the rule when the rule's first commit is not among
    them: a shallow history is no reason to check nothing."""
    assert _git("rev-parse", "--git-dir").returncode == 0, "not a git checkout: the test reads its history"
    since = _git("cat-file", "-e", f"{SUBJECT_RULE_SINCE}^{{commit}}").returncode == 0
    shallow = _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    assert since or shallow, f"{SUBJECT_RULE_SINCE} is not in this full history"
    proc = _git("log", "--format=%h %s", f"{SUBJECT_RULE_SINCE}^..HEAD" if since else "HEAD")
    if since and proc.returncode != 0:  # the rule's first commit is the shallow history's first: no parent
        proc = _git("log", "--format=%h %s", "HEAD")
    assert proc.returncode == 0, proc.stderr
    subjects = proc.stdout.splitlines()
    assert subjects, "no commits read"
    long = [line for line in subjects if len(line.split(" ", 1)[1]) > 72]
    assert not long, long


def test_fmt_skip_only_for_tables():
    skips = [
        f"{f.relative_to(REPO)}:{i}"
        for f in _runtime_files()
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if "# fmt: skip" in line
    ]
    assert skips, "none found: the walk is broken, or the rule can go"
    assert len(skips) <= MAX_FMT_SKIPS, skips
