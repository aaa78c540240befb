"""The working copy a warm runner or a slot keeps between calls: restored to the shipped project before each later
call, so what one call wrote never reaches the next (the cold path's promise), without copying the tree anew."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kinetic_prefect.pod import working_copy

pytestmark = pytest.mark.no_server


@pytest.fixture
def reusing(monkeypatch):
    monkeypatch.setattr(working_copy, "_reuse", True)
    monkeypatch.setattr(working_copy, "_kept", {})
    yield
    working_copy.remove_kept()


def _shipped(root: Path) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "main.py").write_text("VALUE = 'original'\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "sub" / "data.txt").write_text("12345")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "link").symlink_to("main.py")
    (root / ".kinetic-complete").write_text("sha")
    return root


def _tree(root: Path) -> dict[str, object]:
    found: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if "__pycache__" in path.parts:
            continue
        if path.is_symlink():
            found[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = (path.read_bytes(), stat.S_IMODE(path.stat().st_mode))
    return found


def test_a_kept_copy_is_put_back_as_shipped_whatever_the_last_call_did(tmp_path, reusing):
    shipped = _shipped(tmp_path / "shipped")
    expected = _tree(shipped)
    del expected[".kinetic-complete"]
    work = working_copy.working_copy(shipped, tmp_path)
    assert _tree(work) == expected
    # what a call may do to its copy: rewrite a module (same size), add junk files and folders, remove a file and a
    # folder, change a mode, turn a file into a folder, repoint a link, leave bytecode
    (work / "main.py").write_text("VALUE = 'vandal!'\n")
    (work / "junk.txt").write_text("junk")
    (work / "newdir" / "deep").mkdir(parents=True)
    (work / "newdir" / "deep" / "x.py").write_text("x")
    (work / "pkg" / "__init__.py").unlink()
    (work / "pkg" / "sub" / "data.txt").unlink()
    (work / "pkg" / "sub").rmdir()
    (work / "run.sh").chmod(0o644)
    (work / "link").unlink()
    (work / "link").symlink_to("junk.txt")
    (work / "pkg" / "__pycache__").mkdir()
    (work / "pkg" / "__pycache__" / "m.pyc").write_bytes(b"bytecode")
    working_copy.release(work)
    assert work.is_dir(), "a process that runs call after call keeps its copy"

    again = working_copy.working_copy(shipped, tmp_path)
    assert again == work, "the next call runs in the same folder"
    assert _tree(again) == expected
    assert (again / "pkg" / "__pycache__" / "m.pyc").exists(), "bytecode stays: Python checks it against its source"

    working_copy.remove_kept()
    assert not work.exists()


def test_a_cold_job_copies_and_removes_its_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(working_copy, "_reuse", False)
    shipped = _shipped(tmp_path / "shipped")
    first = working_copy.working_copy(shipped, tmp_path)
    (first / "junk.txt").write_text("junk")
    working_copy.release(first)
    assert not first.exists()
    second = working_copy.working_copy(shipped, tmp_path)
    assert second != first and not (second / "junk.txt").exists()
    working_copy.release(second)


def test_a_kept_copy_removed_under_the_process_is_made_again(tmp_path, reusing):
    """A local warm runner's copy lives in its first call's job folder, which the launcher removes after that call."""
    shipped = _shipped(tmp_path / "shipped")
    (tmp_path / "job1").mkdir()
    first = working_copy.working_copy(shipped, tmp_path / "job1")
    import shutil

    shutil.rmtree(tmp_path / "job1")
    (tmp_path / "job2").mkdir()
    second = working_copy.working_copy(shipped, tmp_path / "job2")
    assert second != first and (second / "main.py").read_text() == "VALUE = 'original'\n"


def test_a_warm_runner_finds_the_projects_modules_while_sys_modules_changes(tmp_path, monkeypatch):
    """Between calls a warm runner drops the project's modules from ``sys.modules`` (the next call imports its own
    copy); a thread the last call left running may import meanwhile, and the walk failed with "RuntimeError:
    dictionary changed size during iteration". tests/support/collection_imports.py makes the interleaving
    certain."""
    import sys

    from collection_imports import imports_during_collections

    from kinetic_prefect.pod import warm_runner

    project = tmp_path / "project"
    project.mkdir()
    (project / "proj_model.py").write_text("WEIGHTS = 1\n")
    monkeypatch.syspath_prepend(str(project))
    import proj_model  # noqa: F401 - the last call's project module

    elsewhere = tmp_path / "elsewhere"  # the thread's modules are not the project's
    elsewhere.mkdir()
    try:
        with imports_during_collections(elsewhere) as imported:
            names = warm_runner._project_modules({str(project)})
    finally:
        sys.modules.pop("proj_model", None)
    assert imported, "no collection ran during the walk: the test did not make the interleaving it is about"
    assert names == ["proj_model"]
