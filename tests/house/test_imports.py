"""The package's import graph: no cycles, and each side imports only what docs/ARCHITECTURE.md allows.

Every import counts, at module level and inside functions (an import inside a function still runs,
only later: hiding a cycle there is how the cycles of the past stayed alive). ``if TYPE_CHECKING:`` blocks never
run, so the side rule leaves them out; a cycle through them is still a cycle of types (two modules that each
need the other's names), and the cycle test counts them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kinetic_prefect

pytestmark = pytest.mark.no_server

PACKAGE_DIR = Path(kinetic_prefect.__file__).parent
PACKAGE = "kinetic_prefect"

# The sides (docs/ARCHITECTURE.md, "Who imports whom"): a side is a package, so a module's place says its
# side. Outside the side packages only the leaves, the deployment steps and the kept public paths live; a new
# top-level module fails the test until it is put on a side.
SIDE_PACKAGES = {
    "contract": "contract",
    "pod": "pod",
    "shared": "shared",
    "caller": "caller",
    "workers": "worker",
    "cli": "tools",  # the kinetic-prefect command, one module per command group
}
KINETIC_API_PACKAGE = "kinetic"  # the Kinetic-compatible API: a caller-side facade over kinetic_task
LEAVES = {"storage", "signing", "errors", "accelerators", "config", "version"}  # ship to the pod; import the contract
# Beside the catalog, on the caller side (the decorator and the kinetic API read names through it; no job needs it).
CALLER_LEAVES = {"accelerator_names"}
TOOLS = {"steps"}  # the deployment steps prefect.yaml names by their path
# The short public paths of pod modules (each aliases its module): ``python -m kinetic_prefect.runner``, the command
# of pool templates and images made before the pod/ layout, and the job-side imports the docs show.
KEPT_PATHS = {"runner": "pod.runner", "progress": "pod.progress", "outputs": "pod.outputs"}

# Who may import whom (besides itself): the pod never reaches the caller or the worker (it ships alone to a
# job), shared helpers never reach a side, the worker never reaches the caller; the caller reaches the worker
# only to submit in-process (pools); tools (the CLI, doctor, deployment steps) may use anything.
ALLOWED = {
    "contract": {"contract"},
    "leaf": {"contract"},
    "pod": {"contract", "leaf"},
    "kept path": {"pod"},
    "shared": {"contract", "leaf", "pod"},
    "worker": {"contract", "leaf", "pod", "shared"},
    "caller": {"contract", "leaf", "pod", "shared"},
    "tools": {"contract", "leaf", "pod", "shared", "caller", "worker"},
}
CALLER_INTO_WORKER = {"caller.pools"}  # the registry finds a pool's worker class; everything else goes through it


def side_of(module: str) -> str:
    short = module.removeprefix(f"{PACKAGE}.") if module != PACKAGE else "__init__"
    top = short.split(".")[0]
    if short == "__init__":
        return "caller"  # the public names, loaded lazily from the caller (and pod) modules
    if top in SIDE_PACKAGES:
        return SIDE_PACKAGES[top]
    if top == KINETIC_API_PACKAGE:
        return "caller"
    if short in LEAVES:
        return "leaf"
    if short in CALLER_LEAVES:
        return "caller"
    if short in TOOLS:
        return "tools"
    if short in KEPT_PATHS:
        return "kept path"
    raise AssertionError(
        f"{module} is on no side: move it into a side's package, or list it in tests/house/test_imports.py and "
        "docs/ARCHITECTURE.md"
    )


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree``; those under ``if TYPE_CHECKING:`` only with ``type_checking``."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_only(node) and not type_checking:
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph(root: Path, type_checking: bool = False) -> dict[str, set[str]]:
    """``{module: {package modules it imports}}`` for every module under ``root`` (a package directory);
    ``type_checking``: the imports under ``if TYPE_CHECKING:`` count too.

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``.
    The package itself (``kinetic_prefect/__init__``) is only an edge when imported by name: it loads
    its public names lazily, so the implicit import of a parent package runs nothing of ours.
    """
    modules = {module_name(path, root): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), filename=str(path)), type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [
                    f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin for alias in node.names
                ]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and (target != root.name or name == root.name):
                    edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle() -> None:
    found = cycles(import_graph(PACKAGE_DIR))
    assert not found, "import cycles (module-level and function-level imports):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def test_the_package_has_no_cycle_of_types_either() -> None:
    """Two modules that need each other's names only for annotations are still one room split in two: the
    shared names belong in a module both import (``pod.data_ref``, ``workers.job_launcher``)."""
    found = cycles(import_graph(PACKAGE_DIR, type_checking=True))
    assert not found, "import cycles through TYPE_CHECKING imports:\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def test_each_side_imports_only_what_the_architecture_allows() -> None:
    broken = []
    for module, targets in sorted(import_graph(PACKAGE_DIR).items()):
        side = side_of(module)
        for target in sorted(targets):
            target_side = side_of(target)
            if target_side == side:
                continue
            short = module.removeprefix(f"{PACKAGE}.")
            allowed = target_side in ALLOWED[side] or (
                side == "caller" and target_side == "worker" and short in CALLER_INTO_WORKER
            )
            if not allowed:
                broken.append(f"{module} ({side}) imports {target} ({target_side})")
    assert not broken, "imports across sides that docs/ARCHITECTURE.md does not allow:\n" + "\n".join(broken)


GRAPH_START, GRAPH_END = "<!-- import-graph:start -->", "<!-- import-graph:end -->"
ARCHITECTURE = PACKAGE_DIR.parent / "docs" / "ARCHITECTURE.md"


def side_graph(graph: dict[str, set[str]]) -> dict[tuple[str, str], int]:
    """``{(side, side it imports): module imports}`` across sides, from the module graph."""
    arrows: dict[tuple[str, str], int] = {}
    for module, targets in graph.items():
        for target in targets:
            pair = (side_of(module), side_of(target))
            if pair[0] != pair[1]:
                arrows[pair] = arrows.get(pair, 0) + 1
    return arrows


def drawn_graph() -> str:
    """The side graph as docs/ARCHITECTURE.md shows it (between its import-graph markers)."""
    graph = import_graph(PACKAGE_DIR)
    arrows = side_graph(graph)
    sides = sorted({side for pair in arrows for side in pair}, key=list(ALLOWED).index)
    width = max(len(side) for side in sides)
    lines = []
    for side in sides:
        targets = sorted((t for s, t in arrows if s == side), key=list(ALLOWED).index)
        if targets:
            listed = ", ".join(f"{t} ({arrows[side, t]})" for t in targets)
            lines.append(f"{side:<{width}} -> {listed}")
    modules = len(graph)
    edges = sum(len(t) for t in graph.values())
    return (
        f"{GRAPH_START}\n```\n" + "\n".join(lines) + f"\n```\n\n{modules} modules, {edges} imports between them "
        "(module level and in functions); the number after a side is how many module imports make that arrow. "
        f"Drawn by `python tests/house/test_imports.py --write`.\n{GRAPH_END}"
    )


def test_the_architecture_page_draws_the_graph_of_the_code() -> None:
    """docs/ARCHITECTURE.md's import graph is the package's as it is now (each arrow one the side rule allows)."""
    text = ARCHITECTURE.read_text()
    start, end = text.index(GRAPH_START), text.index(GRAPH_END) + len(GRAPH_END)
    assert text[start:end] == drawn_graph(), (
        "docs/ARCHITECTURE.md's import graph is stale: python tests/house/test_imports.py --write"
    )


def test_the_pod_side_is_what_ships_to_a_job() -> None:
    from kinetic_prefect.shared.image import RUNNER_MODULES

    modules = [module_name(path, PACKAGE_DIR) for path in PACKAGE_DIR.rglob("*.py")]
    contract = f"{PACKAGE}.contract"
    # the contract's __init__, the seams it re-exports and its settings table (job_variables does not ship)
    contract_shipping = {contract, f"{contract}.settings", *import_graph(PACKAGE_DIR)[contract]}
    shipping = {
        m.removeprefix(f"{PACKAGE}.")
        for m in modules
        if side_of(m) in {"pod", "leaf", "kept path"} or m in contract_shipping
    }
    shipped = {m.replace("/", ".").removesuffix(".__init__") for m in RUNNER_MODULES if m != "__init__"}
    assert shipped == shipping
    assert "__init__" in RUNNER_MODULES  # the package root, whose public names load lazily


def test_the_side_packages_import_nothing_when_entered() -> None:
    """Importing ``kinetic_prefect.pod.runner`` runs ``pod/__init__`` first: a side's ``__init__`` stays empty of
    imports, so reaching one module of a side loads no other (``workers`` imports its worker types: it is
    Prefect's entry point; ``cli`` its ``main``: the console script's)."""
    for package in ["contract.job_variables", *SIDE_PACKAGES, "workers.local", "workers.gke", KINETIC_API_PACKAGE]:
        init = PACKAGE_DIR / package.split(".")[0] / "__init__.py"
        if "." in package:
            init = PACKAGE_DIR.joinpath(*package.split(".")) / "__init__.py"
        if not init.is_file() or package in {"contract", "workers", "cli", KINETIC_API_PACKAGE}:
            continue
        tree = ast.parse(init.read_text())
        ours = [node.lineno for node in _imports(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert not ours, f"{init.relative_to(PACKAGE_DIR)} imports at lines {ours}"


@pytest.mark.parametrize("kept, module", sorted(KEPT_PATHS.items()))
def test_the_kept_public_paths_are_the_moved_modules(kept: str, module: str) -> None:
    import importlib

    assert importlib.import_module(f"{PACKAGE}.{kept}") is importlib.import_module(f"{PACKAGE}.{module}")


def test_python_dash_m_on_the_kept_runner_path_runs_the_runner(tmp_path: Path) -> None:
    """Images built before the move run ``python -m kinetic_prefect.runner``; it still reads the job's
    environment (and, with none, reports the phase it failed in, as the runner does)."""
    import os
    import subprocess
    import sys

    from kinetic_prefect import contract

    env = {k: v for k, v in os.environ.items() if not k.startswith("KINETIC_")}
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.runner"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == contract.EXIT_NO_OUTCOME, done.stderr
    assert contract.PHASE_READ_ENV in done.stderr, done.stderr


@pytest.mark.parametrize(
    "source, expected",
    [
        ({"a": "from pkg import b\n", "b": "def f():\n    from pkg.a import x\n"}, [["pkg.a", "pkg.b"]]),
        (
            {
                "a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n",
                "b": "import pkg.a\n",
            },
            [],
        ),
        ({"a": "from . import b\n", "b": "from .a import x\n"}, [["pkg.a", "pkg.b"]]),
        ({"a": "import pkg.b\n", "b": "import json\n"}, []),
    ],
)
def test_the_graph_sees_function_level_and_relative_imports(
    tmp_path: Path, source: dict[str, str], expected: list[list[str]]
) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in source.items():
        (package / f"{name}.py").write_text(text)
    assert cycles(import_graph(package)) == expected


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/house/test_imports.py --write   (redraws docs/ARCHITECTURE.md's import graph)")
    text = ARCHITECTURE.read_text()
    start, end = text.index(GRAPH_START), text.index(GRAPH_END) + len(GRAPH_END)
    ARCHITECTURE.write_text(text[:start] + drawn_graph() + text[end:])
