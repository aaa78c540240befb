"""Issue 45, finding 9 (local store): a local store is its owner's alone. Its objects are 0600 and its folders 0700,
so another user of the machine can neither read a call's arguments and values nor swap a payload; and a store root
someone else made (say ``/tmp/kinetic-store``, made first by another user who then owns what is written there) is
refused, naming the folder, its owner and the fix, instead of adopted.

The tests run as root: the other user is a uid given to a folder with ``os.chown``, and a process that drops to it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

from kinetic_prefect.storage import LocalStore, StoreError, open_store

pytestmark = pytest.mark.no_server

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root (the tests run as root)")
OTHER_UID = 54321  # a user that is not the one running the tests


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_objects_are_0600_and_folders_0700(tmp_path) -> None:
    root = tmp_path / "made" / "by" / "the" / "store"
    store = open_store(root)
    store.put_bytes("runs/r1/payload.pkl", b"payload")
    store.put_bytes("runs/r1/outcome.json", b"{}", if_absent=True)
    (tmp_path / "model.pt").write_bytes(b"weights")
    store.put_file("checkpoints/t1/model.pt", tmp_path / "model.pt")
    store.child("outputs/r1").put_bytes("log.txt", b"lines")

    for folder in (tmp_path / "made", root, root / "runs", root / "runs" / "r1", root / "checkpoints" / "t1"):
        assert _mode(folder) == 0o700, folder
    for key in ("runs/r1/payload.pkl", "runs/r1/outcome.json", "checkpoints/t1/model.pt", "outputs/r1/log.txt"):
        assert _mode(root / key) == 0o600, key
    assert _mode(root / "outputs" / "r1") == 0o700

    # a copy out of the store (get_file: a download to the user's folder) is an ordinary file, as before
    store.get_file("runs/r1/payload.pkl", tmp_path / "copy" / "payload.pkl")
    assert _mode(tmp_path / "copy" / "payload.pkl") == 0o644


@pytest.fixture
def open_folder():
    """A folder every user may enter (pytest's own tmp folders are private: they would hide what the store does)."""
    folder = tempfile.mkdtemp(prefix="kinetic-open-")
    os.chmod(folder, 0o755)
    yield pathlib.Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


@AS_ROOT
def test_another_user_can_read_nothing_in_the_store(open_folder) -> None:
    """The attacker: another local user reading a call's payload (its arguments) out of the victim's store, or
    listing its runs."""
    store = open_store(open_folder / "store")
    store.put_bytes("runs/r1/payload.pkl", b"secret arguments")
    payload = open_folder / "store" / "runs" / "r1" / "payload.pkl"
    for command in (["cat", str(payload)], ["ls", str(open_folder / "store")]):
        seen = subprocess.run(command, capture_output=True, text=True, user=OTHER_UID)
        assert seen.returncode != 0 and "Permission denied" in seen.stderr, seen.stdout + seen.stderr
        assert "secret arguments" not in seen.stdout and "runs" not in seen.stdout
    os.chmod(open_folder / "store", 0o755)  # even with the root opened by hand, its folders and objects stay private
    seen = subprocess.run(["cat", str(payload)], capture_output=True, text=True, user=OTHER_UID)
    assert seen.returncode != 0 and "secret arguments" not in seen.stdout


@AS_ROOT
def test_a_root_another_user_made_is_refused(tmp_path) -> None:
    """The attacker made the shared folder first (``mkdir -m 777 /tmp/kinetic-store``) and so owns whatever the
    victim writes there: the victim's store refuses it, naming the folder, its owner and the fix, and writes nothing."""
    planted = tmp_path / "kinetic-store"
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    os.chown(planted, OTHER_UID, OTHER_UID)

    with pytest.raises(StoreError) as refused:
        open_store(planted)
    message = str(refused.value)
    assert str(planted) in message and f"uid {OTHER_UID}" in message
    assert "KINETIC_STORE" in message and "chown" in message  # the fix: a folder of your own, or take it back
    with pytest.raises(StoreError, match="not to"):
        LocalStore(planted)
    assert list(planted.iterdir()) == []  # nothing written into the attacker's folder

    # a symlink of the victim's own pointing at the attacker's folder is the attacker's folder
    link = tmp_path / "my-store"
    link.symlink_to(planted)
    with pytest.raises(StoreError, match=str(planted)):
        open_store(link)


def test_a_store_of_ones_own_still_opens_from_another_process(tmp_path) -> None:
    """The same user in another process (a worker, a job, a job's uv environment) reads and writes as before."""
    store = open_store(tmp_path / "store")
    store.put_bytes("runs/r1/payload.pkl", b"p")
    code = (
        "from kinetic_prefect.storage import open_store\n"
        f"s = open_store({str(tmp_path / 'store')!r})\n"
        "assert s.get_bytes('runs/r1/payload.pkl') == b'p'\n"
        "s.put_bytes('runs/r1/result.pkl', b'r')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert store.get_bytes("runs/r1/result.pkl") == b"r"
