"""No switch on a worker-type name outside the workers (issue 46): the caller, the Kinetic API and the CLI ask a
pool's launcher what it can do (``caller.pools.abilities_of``, ``contract.launchers.LauncherAbilities``) instead
of comparing its type with ``"kinetic-gke"``.

The rule, on the code's syntax tree: in ``kinetic_prefect/caller/``, ``kinetic_prefect/kinetic/`` and
``kinetic_prefect/cli/`` no string literal *is* a worker-type name (``"kinetic-gke"``, any value of
``contract.WORKER_TYPES``), and no name or attribute is one of the contract's constants holding one
(``GKE_WORKER_TYPE``...). Documentation may name the products: docstrings are left out, and so is a name inside
longer text (a help line, an error message saying where a call can run), which is prose, not a value a branch
compares. ``WORKER_TYPES``, the list of every type, is allowed: naming all of them favours none.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kinetic_prefect
from kinetic_prefect import contract

pytestmark = pytest.mark.no_server

PACKAGE_DIR = Path(kinetic_prefect.__file__).parent
CHECKED = ("caller", "kinetic", "cli")
TYPE_NAMES = set(contract.WORKER_TYPES)
TYPE_CONSTANTS = {
    name
    for name in dir(contract)
    if name.isupper() and isinstance(value := getattr(contract, name), str) and value in TYPE_NAMES
}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string nodes that are docstrings (a bare string statement is documentation too)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def worker_type_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of each worker-type name used as a value in ``source``."""
    tree = ast.parse(source)
    documentation = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in TYPE_NAMES and id(node) not in documentation:
            found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Name) and node.id in TYPE_CONSTANTS:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and node.attr in TYPE_CONSTANTS:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name in TYPE_CONSTANTS]
    return found


def test_the_rule_sees_a_switch_and_leaves_documentation_alone():
    switch = 'from kinetic_prefect.contract import GKE_WORKER_TYPE\nif pool.type == "kinetic-gke": pass\n'
    assert [what for _, what in worker_type_uses(switch)] == ["import GKE_WORKER_TYPE", "'kinetic-gke'"]
    assert worker_type_uses("x = contract.GKE_WORKER_TYPE\n") == [(1, "GKE_WORKER_TYPE")]
    prose = '"""Runs on kinetic-gke."""\nhelp = "the kinetic-gke work pool"\ntypes = contract.WORKER_TYPES\n'
    assert worker_type_uses(prose) == []


def test_no_worker_type_name_in_the_caller_the_kinetic_api_or_the_cli():
    assert TYPE_NAMES and TYPE_CONSTANTS, "the contract names no worker type"
    found = [
        f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {what}"
        for package in CHECKED
        for path in sorted((PACKAGE_DIR / package).rglob("*.py"))
        for line, what in worker_type_uses(path.read_text())
    ]
    assert not found, (
        "a worker-type name used as a value outside workers/: ask the pool's launcher what it can do "
        "(caller.pools.abilities_of) or call a hook on its worker class instead:\n" + "\n".join(found)
    )
