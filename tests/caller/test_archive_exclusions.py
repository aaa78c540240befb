"""What never rides in a call's project archive, whoever put it in the project, and what a ``Data`` upload never
follows out of its directory.

Issue 57, defect 2: with ``PREFECT_HOME=./.prefect`` (a per-project Prefect home) and the temporary server, every
call's archive held ``prefect.db`` (its Fernet key is in it, beside the encrypted Secret blocks: code in the job
decrypted ``kinetic-signing-key``, the master key), and a store named by the pool's ``store`` variable inside the
project shipped itself, earlier archives included, call after call. Issue 54, finding 8 (part): a committed link to
``~/.ssh/id_rsa`` shipped the key in the archive, and a ``Data`` directory's link out of it uploaded its target.

Each test builds the archive as a call does (``cached_project_archive``, then the code and a payload put into the
store) and reads what is inside it.
"""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_HOME, temporary_settings

from kinetic_prefect.caller.payload import cached_project_archive
from kinetic_prefect.contract import Env, RunLayout
from kinetic_prefect.storage import LocalStore

pytestmark = pytest.mark.no_server

SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- attacker-wants-this"


def _project(root: Path, git: bool = False) -> Path:
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname='proj'\n")
    (root / "train.py").write_text("def train(x):\n    return x\n" + "# padding\n" * 2000)
    if git:
        subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def _commit(root: Path) -> None:
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    subprocess.run(
        ["git", "-C", str(root), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x"], check=True
    )


def _inside(archive) -> tuple[set[str], bytes]:
    raw = gzip.decompress(archive.data)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        return set(tar.getnames()), raw


def _calls(project: Path, store: LocalStore, count: int = 3) -> tuple[list[int], set[str], bytes]:
    """``count`` calls' archives, each put into the store with a payload as a call uploads them."""
    sizes, names, raw = [], set(), b""
    for call in range(count):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            archive = cached_project_archive(project)
        store.put_bytes(archive.key, archive.data)
        store.put_bytes(RunLayout(f"run-{call}").payload, b"p" * 100_000)
        sizes.append(len(archive.data))
        shipped, raw = _inside(archive)
        names |= shipped
    return sizes, names, raw


def _prefect_home(home: Path) -> None:
    """What Prefect's temporary server leaves in its home: the database (the Fernet key is a row of it), its
    journal files, the profiles (an API key), results."""
    (home / "storage").mkdir(parents=True)
    (home / "prefect.db").write_bytes(b"SQLite format 3\0 fernet_key=" + b"k" * 5000)
    (home / "prefect.db-wal").write_bytes(b"wal" * 1000)
    (home / "profiles.toml").write_text('[profiles.default]\nPREFECT_API_KEY = "pnu_secret"\n')
    (home / "storage" / "result-1").write_bytes(b"a pickled result")


@pytest.mark.parametrize("home_name", [".prefect", "state/prefect-home"])
def test_a_prefect_home_inside_the_project_is_never_shipped(tmp_path, monkeypatch, home_name):
    """PREFECT_HOME under the project, by Prefect's usual name or another: none of it is in any call's archive, and
    three calls do not grow it."""
    project = _project(tmp_path / "project")
    monkeypatch.chdir(project)
    monkeypatch.setenv(Env.STORE, str(tmp_path / "store"))
    _prefect_home(project / home_name)
    with temporary_settings({PREFECT_HOME: f"./{home_name}"}):
        sizes, names, raw = _calls(project, LocalStore(tmp_path / "store"))
    assert names == {"pyproject.toml", "train.py"}, names
    assert b"fernet_key" not in raw and b"pnu_secret" not in raw
    assert sizes[0] == sizes[1] == sizes[2], sizes


def test_a_prefect_home_around_the_project_leaves_the_project_whole(tmp_path, monkeypatch):
    """PREFECT_HOME=~ with the project in ~: Prefect's files are left out, the project's code is not."""
    project = _project(tmp_path / "project")
    monkeypatch.chdir(project)
    monkeypatch.setenv(Env.STORE, str(tmp_path / "store"))
    with temporary_settings({PREFECT_HOME: str(tmp_path)}):
        _sizes, names, _raw = _calls(project, LocalStore(tmp_path / "store"), count=1)
    assert names == {"pyproject.toml", "train.py"}, names


def test_prefect_s_database_is_never_shipped_wherever_its_url_puts_it(tmp_path, monkeypatch):
    """PREFECT_API_DATABASE_CONNECTION_URL naming a SQLite file of the project (relative, as a user writes it)."""
    project = _project(tmp_path / "project")
    monkeypatch.chdir(project)
    monkeypatch.setenv(Env.STORE, str(tmp_path / "store"))
    (project / "db").mkdir()
    (project / "db" / "server.sqlite").write_bytes(b"SQLite format 3\0 fernet_key")
    (project / "db" / "server.sqlite-journal").write_bytes(b"journal")
    url = "sqlite+aiosqlite:///db/server.sqlite"
    with temporary_settings({PREFECT_API_DATABASE_CONNECTION_URL: url, PREFECT_HOME: str(tmp_path / "home")}):
        _sizes, names, _raw = _calls(project, LocalStore(tmp_path / "store"), count=1)
    assert names == {"pyproject.toml", "train.py"}, names


def test_a_per_project_prefect_home_set_in_the_environment_is_never_shipped(tmp_path):
    """As a user runs it: ``PREFECT_HOME=./.prefect python flow.py`` with no profile, in a process of its own
    (Prefect reads PREFECT_HOME once, at import; about 5 s to import Prefect)."""
    project = _project(tmp_path / "project")
    _prefect_home(project / ".prefect")
    script = (
        "import io, tarfile, gzip\n"
        "from kinetic_prefect.caller.payload import cached_project_archive\n"
        "archive = cached_project_archive('.')\n"
        "print(sorted(tarfile.open(fileobj=io.BytesIO(gzip.decompress(archive.data))).getnames()))\n"
    )
    env = {**os.environ, "PREFECT_HOME": "./.prefect", Env.STORE: str(tmp_path / "store")}
    env.pop("PREFECT_PROFILES_PATH", None)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=project, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['pyproject.toml', 'train.py']", out.stdout


@pytest.mark.parametrize("git", [False, True], ids=["plain folder", "git repository"])
def test_a_store_the_pool_names_inside_the_project_is_never_shipped(tmp_path, monkeypatch, git):
    """The pool's ``store`` variable (not KINETIC_STORE, which names another folder) is ``./artifacts`` of the
    project: before, each call shipped the store, earlier archives included (14 MB after 3 no-op calls)."""
    project = _project(tmp_path / "project", git=git)
    monkeypatch.chdir(project)
    monkeypatch.setenv(Env.STORE, str(tmp_path / "elsewhere"))
    pool_store = LocalStore(project / "artifacts")  # what gcp.open_store makes of the pool's `store`
    if git:
        _commit(project)
    sizes, names, _raw = _calls(project, pool_store)
    assert names == {"pyproject.toml", "train.py"}, names
    assert sizes[0] == sizes[1] == sizes[2], sizes


def _outside_secret(tmp_path: Path) -> Path:
    outside = tmp_path / "home" / ".ssh"
    outside.mkdir(parents=True)
    (outside / "id_rsa").write_bytes(SECRET)
    (outside / "config").write_bytes(SECRET + b" config")
    return outside


@pytest.mark.parametrize("git", [False, True], ids=["plain folder", "git repository"])
def test_a_link_out_of_the_project_does_not_ship_its_target(tmp_path, monkeypatch, git):
    """The attacker's commit: ``deploy_key -> ~/.ssh/id_rsa`` and ``notes/ssh -> ~/.ssh`` in the project. The
    archive holds neither target's bytes and a warning names the links; a link inside the project still ships."""
    outside = _outside_secret(tmp_path)
    project = _project(tmp_path / "project", git=git)
    monkeypatch.setenv(Env.STORE, str(tmp_path / "store"))
    (project / "deploy_key").symlink_to(outside / "id_rsa")
    (project / "notes").mkdir()
    (project / "notes" / "ssh").symlink_to(outside)
    (project / "notes" / "ssh_config").symlink_to("../../home/.ssh/config")  # relative, out all the same
    (project / "alias.py").symlink_to("train.py")  # inside: shipped as today
    if git:
        _commit(project)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        archive = cached_project_archive(project)
    names, raw = _inside(archive)
    assert SECRET not in raw
    assert names == {"alias.py", "pyproject.toml", "train.py"}, names
    message = "\n".join(str(w.message) for w in caught)
    assert "deploy_key" in message and "notes/ssh_config" in message and "outside the project" in message, message


def test_a_data_directory_s_link_out_of_it_is_refused_before_anything_is_uploaded(tmp_path):
    """``Data(dir)`` whose ``dir/extra -> ~/.ssh/id_rsa``: refused at ``Data()``, naming the link and the fix; a link
    between files of the directory still works."""
    from kinetic_prefect.pod.data import Data, DataError, hash_local

    outside = _outside_secret(tmp_path)
    data = tmp_path / "dataset"
    (data / "train").mkdir(parents=True)
    (data / "train" / "a.csv").write_text("1,2\n")
    (data / "train" / "b.csv").symlink_to("a.csv")
    manifest = hash_local(Data(str(data)))
    assert sorted(rel for rel, _size, _sha in manifest.files) == ["train/a.csv", "train/b.csv"]

    (data / "extra").symlink_to(outside / "id_rsa")
    with pytest.raises(DataError, match=r"extra.*outside the data directory") as refused:
        Data(str(data))
    assert "Copy it into the data directory" in str(refused.value) and str(outside / "id_rsa") in str(refused.value)
    (data / "extra").unlink()
    (data / "train" / "keys").symlink_to(outside)
    with pytest.raises(DataError, match=r"train/keys.*outside the data directory"):
        Data(str(data))


def test_a_data_directory_changed_after_data_was_made_is_refused_at_hashing(tmp_path):
    """The link appears between ``Data()`` and the call (the hashing walk that picks what is uploaded)."""
    from kinetic_prefect.pod.data import Data, DataError, hash_local

    outside = _outside_secret(tmp_path)
    data = tmp_path / "dataset"
    data.mkdir()
    (data / "a.csv").write_text("1,2\n")
    item = Data(str(data))
    (data / "b.csv").symlink_to(outside / "id_rsa")
    with pytest.raises(DataError, match="outside the data directory"):
        hash_local(item)
