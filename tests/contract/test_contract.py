"""The contract is complete: every ``KINETIC_*`` name, runner phase, marker and envelope version lives in
``kinetic_prefect/contract/``; the other modules use its names (the tests may spell them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kinetic_prefect
from kinetic_prefect import contract

pytestmark = pytest.mark.no_server

PACKAGE_DIR = Path(kinetic_prefect.__file__).parent


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """The ids of docstring constants: documentation may name a variable; code must use the contract's name."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def code_strings(path: Path, matches) -> list[str]:
    """The file's string literals (f-string parts included, docstrings not) for which ``matches(text)`` holds."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = _docstring_nodes(tree)
    return [
        f"{path.name}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and matches(node.value)
        and id(node) not in docstrings
    ]


def kinetic_literals(path: Path) -> list[str]:
    return code_strings(path, lambda text: "KINETIC_" in text)


def outside_the_contract(scan) -> list[str]:
    """``scan(path)``'s hits in every package module but the contract's."""
    return [
        f"{path.parent.name}/{hit}"
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if path.parent != PACKAGE_DIR / "contract"
        for hit in scan(path)
    ]


def test_no_kinetic_literal_outside_the_contract() -> None:
    offenders = outside_the_contract(kinetic_literals)
    assert not offenders, "KINETIC_ names outside the contract package (use contract.Env):\n" + "\n".join(offenders)


def test_the_scan_sees_code_strings_and_f_strings_but_not_docstrings(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Reads KINETIC_STORE."""\nX = "KINETIC_A"\ndef f(v):\n    """KINETIC_B"""\n    return f"KINETIC_C={v}"\n'
    )
    hits = kinetic_literals(sample)
    assert [hit.rsplit(": ", 1)[1] for hit in hits] == ["'KINETIC_A'", "'KINETIC_C='"]


def test_every_env_name_is_a_kinetic_name_and_unique() -> None:
    names = {k: v for k, v in vars(contract.Env).items() if not k.startswith("_")}
    assert all(v.startswith("KINETIC_") for v in names.values()), names
    assert len(set(names.values())) == len(names)


def test_the_runner_reports_its_phases_and_markers_by_the_contract_names() -> None:
    from kinetic_prefect.pod import runner

    assert runner.JobTerminated.__name__ == contract.JOB_TERMINATED_TYPE
    stopped = contract.Outcome(status=contract.FAILED, error_type=f"__main__.{contract.JOB_TERMINATED_TYPE}")
    assert stopped.terminated
    assert not contract.Outcome(status=contract.FAILED, error_type="builtins.KeyError").terminated
    source = (PACKAGE_DIR / "pod" / "runner.py").read_text()
    phases = [v for k, v in vars(contract).items() if k.startswith("PHASE_")]
    # Every phase the runner names is the contract's (a phase spelled in the runner would not be in this list).
    calls = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "run" and node.args
    ]
    assert calls
    for call in calls:
        assert not isinstance(call.args[0], ast.Constant), f"runner.py:{call.lineno} names a phase as a literal"
    assert len(set(phases)) == len(phases)


def test_the_payload_envelope_version_is_the_contracts() -> None:
    import pickle

    from kinetic_prefect.caller.payload import build_call_payload

    envelope = pickle.loads(build_call_payload(len, ((),), {}, None))
    assert envelope["format"] == contract.PAYLOAD_FORMAT


def test_the_decorator_lists_its_options_once() -> None:
    """``kinetic_task``'s own parameters (written out for the reader and the IDE) are the fields of ``TaskOptions``,
    where the options are declared, with the same defaults; ``KINETIC_OPTION_NAMES`` is derived from them."""
    import inspect

    from kinetic_prefect.caller import decorator
    from kinetic_prefect.caller.options import TaskOptions

    options = inspect.signature(TaskOptions).parameters
    own = [
        p
        for p in inspect.signature(decorator.kinetic_task).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert [(p.name, p.default) for p in own] == [(p.name, p.default) for p in options.values()]
    assert tuple(options) == decorator.KINETIC_OPTION_NAMES


EVENT_NAME_PREFIXES = ("kinetic.job.", "kinetic.flow-run.", "kinetic.work-pool.")


def event_literals(path: Path) -> list[str]:
    """Event names spelled outside the contract: a string literal that is one, or a literal phase handed to
    ``emit_job_event`` (which prefixes it)."""
    hits = code_strings(path, lambda text: text.startswith(EVENT_NAME_PREFIXES))
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "emit_job_event"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            hits.append(f"{path.name}:{node.lineno}: emit_job_event(..., {node.args[1].value!r})")
    return hits


def test_no_event_name_outside_the_contract() -> None:
    offenders = outside_the_contract(event_literals)
    assert not offenders, "event names outside the contract (use its EVENT_* names):\n" + "\n".join(offenders)


def test_the_event_scan_sees_names_and_literal_phases(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Emits kinetic.job.cost."""\nA = "kinetic.work-pool.warm-idle"\n'
        'def f(w, r):\n    w.emit_job_event(r, "exited", None)\n    w.emit_job_event(r, PHASE, None)\n'
    )
    assert [hit.rsplit(": ", 1)[1] for hit in event_literals(sample)] == [
        "'kinetic.work-pool.warm-idle'",
        "emit_job_event(..., 'exited')",
    ]


STORE_ROOTS = ("runs/", "warm/", "sweeps/", "data/", "outputs/", "code/", "checkpoints/", "locks/")
STORE_NAMES = ("manifest.json", "/files", "job.log", "outcome.json", "payload.pkl", "result.pkl")


def layout_literals(path: Path) -> list[str]:
    """Store keys, record and log names, and worker type names spelled outside the contract: a literal that
    starts with a store root, ends with one of its object names, or is a worker type."""

    def is_layout(text: str) -> bool:
        return (
            text.startswith(STORE_ROOTS)
            or text.endswith(STORE_NAMES)
            or (text.startswith("host-") and text.endswith(".log"))
            or text in contract.WORKER_TYPES
        )

    return code_strings(path, is_layout)


def test_no_store_key_log_name_or_worker_type_outside_the_contract() -> None:
    offenders = outside_the_contract(layout_literals)
    assert not offenders, (
        "store keys, log names or worker types outside the contract (use RunLayout, data_key, WarmPodKeys, "
        "host_log_name, LOCAL_WORKER_TYPE / GKE_WORKER_TYPE):\n" + "\n".join(offenders)
    )


def test_the_layout_scan_sees_keys_names_and_types(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Writes runs/<id>/outcome.json."""\nA = "warm/runs/"\ndef f(k, i):\n'
        '    return f"{k}/manifest.json", f"host-{i}.log", "kinetic-gke", "kinetic-gke-worker"\n'
    )
    assert sorted(hit.rsplit(": ", 1)[1] for hit in layout_literals(sample)) == [
        "'/manifest.json'",
        "'kinetic-gke'",
        "'warm/runs/'",
    ]
