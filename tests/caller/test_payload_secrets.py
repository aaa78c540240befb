"""Secret-looking files stay on the caller's machine unless the project opts one in."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import warnings

import pytest

from kinetic_prefect.caller.payload import archive_project, cached_project_archive, collect_project_files

pytestmark = pytest.mark.no_server

SECRETS = [".env", "key.pem", "id_rsa", "config/kaggle.json", "deploy/.env.production"]


def _project(tmp_path, name="proj"):
    root = tmp_path / name
    (root / "config").mkdir(parents=True)
    (root / "deploy").mkdir()
    (root / "pyproject.toml").write_text("[project]\nname='proj'\n")
    (root / "train.py").write_text("print('train')\n")
    (root / "config" / "model.yaml").write_text("depth: 3\n")
    for rel in SECRETS:
        (root / rel).write_text("do not ship\n")
    return root


def _archived(archive) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(archive.data), mode="r:gz") as tar:
        return set(tar.getnames())


def _archive_with_warnings(root, build=archive_project):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        archive = build(root)
    return archive, [str(w.message) for w in caught]


def test_secret_looking_files_are_left_out_of_the_archive_and_listed(tmp_path):
    root = _project(tmp_path)
    archive, messages = _archive_with_warnings(root)
    assert _archived(archive) == {"config/model.yaml", "pyproject.toml", "train.py"}
    assert collect_project_files(root) == ["config/model.yaml", "pyproject.toml", "train.py"]
    [message] = [m for m in messages if "secret" in m]
    for rel in SECRETS:
        assert rel in message
    assert "left out" in message and "!.env" in message and ".kineticignore" in message


def test_a_negated_pattern_in_kineticignore_ships_that_file(tmp_path):
    root = _project(tmp_path)
    (root / ".kineticignore").write_text("# the job needs the TLS key\n!key.pem\n")
    archive, messages = _archive_with_warnings(root, cached_project_archive)
    shipped = _archived(archive)
    assert "key.pem" in shipped
    assert not {".env", "id_rsa", "config/kaggle.json", "deploy/.env.production"} & shipped
    [message] = [m for m in messages if "secret" in m]
    assert "key.pem" not in message.split("!")[0], "an opted-in file is not listed as left out"


def test_secret_looking_python_code_is_shipped_with_a_warning(tmp_path):
    root = _project(tmp_path)
    (root / "secrets_manager.py").write_text("def get(name):\n    return name\n")
    archive, messages = _archive_with_warnings(root)
    assert "secrets_manager.py" in _archived(archive), "source code is needed by the job's imports"
    assert any("secrets_manager.py" in m for m in messages)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_secrets_tracked_by_git_are_left_out_too(tmp_path):
    root = _project(tmp_path, "repo")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    archive, _ = _archive_with_warnings(root)
    assert _archived(archive) == {"config/model.yaml", "pyproject.toml", "train.py"}
