"""Checkpoints and outputs are signed: a store writer without the key cannot run code in a retried job through a
swapped checkpoint, nor in the caller through a swapped output (finding 4 of issue 45).

A signed job writes, after its checkpoints (each sync) and after its outputs (per host), a manifest of every file's
size and sha256, signed with its own run's keys; a retry restores only what the manifest lists, each file checked,
and ``JobOutputs.download`` checks with the caller's key before anything lands in the destination. The attacks run
as an attacker would: a write to the store between the attempts, or between the job and the download."""

from __future__ import annotations

import json
import pickle
import threading
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowFilter, FlowFilterName

from kinetic_prefect import JobOutputs, kinetic_task, signing
from kinetic_prefect.contract import RunLayout
from kinetic_prefect.storage import LocalStore, open_store


class _Boom:
    """Unpickling this writes a file: stands in for the code a forged pickle would run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path(self.path).write_text, ("pwned",))


def _job_envs(name: str) -> list[dict]:
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
    return [run.job_variables["env"] for run in sorted(runs, key=lambda r: r.created)]


def _pool_with_store(store_url: str) -> str:
    from kinetic_prefect.workers.base import load_template

    name = f"ckpt-sig-{uuid.uuid4().hex[:6]}"
    template = load_template("kinetic-local")
    template["variables"]["properties"]["store"]["default"] = store_url
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="kinetic-local", base_job_template=template))
    return name


def _swap_between_attempts(store, name: str, forged: bytes, relist: bool, swapped: threading.Event, stop) -> None:
    """The attacker: write access to the store, no key. Once the first attempt has ended (its outcome is in the
    store, so its checkpoints are saved), replace its model.pkl; ``relist``: and rewrite the manifest it finds
    beside it to list the forged bytes."""
    import hashlib

    deadline = time.monotonic() + 120
    while not stop.is_set() and time.monotonic() < deadline:
        for env in _job_envs(name)[:1]:
            folder = env["KINETIC_CHECKPOINT_KEY"]
            if store.exists(RunLayout(env["KINETIC_RUN_ID"]).outcome) and store.exists(f"{folder}/model.pkl"):
                store.put_bytes(f"{folder}/model.pkl", forged)
                if relist:
                    files = {"model.pkl": [[len(forged), hashlib.sha256(forged).hexdigest()]]}
                    for object_key in store.list(folder):
                        if object_key.endswith("manifest.json"):
                            store.put_bytes(object_key, json.dumps({"files": files}).encode())
                swapped.set()
                return
        time.sleep(0.05)


@pytest.mark.parametrize(
    "backend,attack",
    [("local", "swap"), ("local", "swap-and-relist"), ("gcs", "swap")],
    ids=["local-swap", "local-swap-and-relist", "gcs-swap"],
)
@pytest.mark.slow
def test_a_swapped_checkpoint_is_refused_by_the_retry(backend, attack, request, store_dir, tmp_path, monkeypatch):
    """Attempt 1 saves model.pkl and fails; the attacker replaces it in the store (and, in one variant, rewrites
    the manifest to list it); attempt 2 must refuse the restore before the function unpickles anything. ≈ 10 s a
    variant: two jobs and a 2 s retry delay."""
    from kinetic_prefect.errors import KineticJobSetupError

    monkeypatch.setenv("KINETIC_SIGNING_KEY", "ckpt-key-" + uuid.uuid4().hex)
    if backend == "gcs":
        url = f"{request.getfixturevalue('gcs_bucket')}/kinetic"
        pool, store = _pool_with_store(url), open_store(url)
    else:
        pool, store = None, LocalStore(store_dir)
    proof = tmp_path / "pwned"
    name = f"ckpt-swap-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool, retries=1, retry_delay_seconds=2)
    def train() -> dict:
        import os as _os
        import pickle as _pickle
        from pathlib import Path as _Path

        ckpt = _Path(_os.environ["KINETIC_CHECKPOINT_DIR"]) / "model.pkl"
        if ckpt.exists():
            return {"resumed": _pickle.loads(ckpt.read_bytes())}
        ckpt.write_bytes(_pickle.dumps({"step": 3}))
        raise RuntimeError("preempted at step 3")

    @flow
    def pipeline():
        return train()

    swapped, stop = threading.Event(), threading.Event()
    attacker = threading.Thread(
        target=_swap_between_attempts,
        args=(store, name, pickle.dumps(_Boom(str(proof))), attack == "swap-and-relist", swapped, stop),
        daemon=True,
    )
    attacker.start()
    try:
        expected = "does not match its signed manifest" if attack == "swap" else "does not match its signature"
        with pytest.raises(KineticJobSetupError, match=f"restoring checkpoints.*{expected}"):
            pipeline()
    finally:
        stop.set()
        attacker.join()
    assert swapped.is_set(), "the attacker found no checkpoint to swap between the attempts"
    assert not proof.exists(), "the attacker's checkpoint was unpickled in the retried job"
    assert len(_job_envs(name)) == 2


@pytest.mark.slow
def test_a_swapped_output_is_refused_by_download(store_dir, tmp_path, monkeypatch):
    """The job's outputs are downloaded by the caller after the flow: a model.pkl swapped in the store (and a file
    planted beside it) never reaches the destination, and nothing is unpickled."""
    from kinetic_prefect.errors import StoreTampered

    monkeypatch.setenv("KINETIC_SIGNING_KEY", "outputs-key-" + uuid.uuid4().hex)
    proof = tmp_path / "pwned"

    @kinetic_task(name=f"outputs-swap-{uuid.uuid4().hex[:6]}")
    def train() -> JobOutputs:
        import os as _os
        import pickle as _pickle
        from pathlib import Path as _Path

        out = _Path(_os.environ["KINETIC_OUTPUT_DIR"])
        (out / "model.pkl").write_bytes(_pickle.dumps({"weights": [1.0, 2.0]}))
        (out / "metrics.json").write_text('{"loss": 0.1}')
        return JobOutputs.current()

    @flow
    def pipeline():
        return train()

    outputs = pipeline()
    folder = store_dir / RunLayout(outputs.run_id).outputs
    (folder / "model.pkl").write_bytes(pickle.dumps(_Boom(str(proof))))  # the attacker, no key
    (folder / "extra.pkl").write_bytes(pickle.dumps(_Boom(str(proof))))

    dest = tmp_path / "models"
    with pytest.raises(StoreTampered, match=r"model\.pkl does not match its signed manifest"):
        pickle.loads(outputs.download("model.pkl", dest).read_bytes())
    with pytest.raises(StoreTampered, match=r"model\.pkl does not match its signed manifest"):
        outputs.download_all(dest)
    assert outputs.names() == ["metrics.json", "model.pkl"], "a file the job did not write is listed"
    with pytest.raises(StoreTampered, match=r"extra\.pkl is not among the outputs"):
        pickle.loads(outputs.download("extra.pkl", dest).read_bytes())
    assert not proof.exists(), "a swapped output was unpickled in the caller"
    assert not dest.exists(), "a refused download wrote to the destination"
    assert outputs.download("metrics.json", dest).read_text() == '{"loss": 0.1}'  # what the job wrote still comes


@pytest.mark.slow
def test_signed_checkpoints_and_outputs_work_across_a_killed_job(tmp_path, monkeypatch):
    """The happy path, signed, on a local store (a private copy synced every 0.2 s instead of the store's own
    folder): attempt 1 is SIGKILLed mid-training after a periodic sync, the retry resumes from the checkpoint it
    saved and leaves outputs the caller downloads. ≈ 8 s: two jobs."""
    monkeypatch.setenv("KINETIC_SIGNING_KEY", "happy-key-" + uuid.uuid4().hex)
    monkeypatch.setenv("KINETIC_CHECKPOINT_SYNC_SECONDS", "0.2")
    store = tmp_path / "store"
    pool = _pool_with_store(str(store))
    marker = tmp_path / "killed-once"

    @kinetic_task(name=f"signed-resume-{uuid.uuid4().hex[:6]}", work_pool=pool, retries=1, retry_delay_seconds=0)
    def count_to(n: int, marker_path: str) -> dict:
        import os as _os
        import signal
        import time as _time
        from pathlib import Path as _Path

        ckpt_dir = _Path(_os.environ["KINETIC_CHECKPOINT_DIR"])
        ckpt = ckpt_dir / "step.txt"
        start = int(ckpt.read_text()) if ckpt.exists() else 0
        for step in range(start, n):
            (ckpt_dir / "weights").mkdir(exist_ok=True)
            (ckpt_dir / "weights" / "w.bin").write_bytes(bytes([step]) * 1000)
            ckpt.write_text(str(step + 1))
            if step + 1 == 3 and not _Path(marker_path).exists():
                _Path(marker_path).write_text("x")
                _time.sleep(1.0)  # long enough for the periodic sync to save step 3
                _os.kill(_os.getpid(), signal.SIGKILL)
        (_Path(_os.environ["KINETIC_OUTPUT_DIR"]) / "final.txt").write_text(ckpt.read_text())
        return {
            "resumed_from": start,
            "seen": sorted(p.name for p in ckpt_dir.rglob("*") if p.is_file()),
            "outputs": JobOutputs.current(),
        }

    @flow
    def pipeline():
        return count_to(5, str(marker))

    from kinetic_prefect.contract import FILES_MANIFEST_NAME

    value = pipeline()
    assert value["resumed_from"] == 3 and value["seen"] == ["step.txt", "w.bin"], value
    outputs = value["outputs"]
    assert outputs.signed and outputs.names() == ["final.txt"]
    assert outputs.download("final.txt", tmp_path / "dl").read_text() == "5"
    [folder] = (store / "checkpoints").iterdir()
    assert (folder / FILES_MANIFEST_NAME).is_file() and (folder / (FILES_MANIFEST_NAME + ".sig")).is_file()


# --------------------------------------------------------------------------- the pieces, without a server


def _job_ring(master: bytes, run_id: str, checkpoint_key: str) -> signing.Keyring:
    return signing.Keyring([master]).for_job(*signing.run_scopes(run_id, checkpoint_key))


@pytest.mark.no_server
def test_a_checkpoint_sync_killed_mid_upload_still_restores(tmp_path, monkeypatch):
    """While a sync replaces a file the manifest lists, the manifest lists both versions: a job killed between the
    upload and the final manifest leaves a folder its retry restores (either version), not a refused one."""
    from kinetic_prefect.pod.runner import CheckpointSync

    monkeypatch.setenv("KINETIC_JOB_DIR", str(tmp_path / "job"))
    master, store = b"master", LocalStore(tmp_path / "store")
    key = "checkpoints/task-run-1"
    ring = _job_ring(master, "run-1", key)
    first = CheckpointSync(store, key, signing_key=ring)
    assert first.restore() == 0
    (first.dir / "model.pkl").write_bytes(b"v1")
    assert first.sync() == 1
    (first.dir / "model.pkl").write_bytes(b"version 2")

    real_write = first.store.put_tree

    def upload_then_die(prefix, files, **kwargs):
        real_write(prefix, files, **kwargs)
        raise SystemExit("killed after the upload, before the final manifest")

    monkeypatch.setattr(first.store, "put_tree", upload_then_die)
    with pytest.raises(SystemExit):
        first.sync()

    retry = CheckpointSync(LocalStore(tmp_path / "store"), key, signing_key=_job_ring(master, "run-2", key))
    assert retry.restore() == 1
    assert (retry.dir / "model.pkl").read_bytes() == b"version 2"
    assert retry.dir != store.local_path(key), "signed: the function works on a checked private copy"


@pytest.mark.no_server
def test_only_listed_and_intact_checkpoint_files_are_restored(tmp_path, monkeypatch, capsys):
    from kinetic_prefect.contract import FILES_MANIFEST_NAME, files_manifest_key
    from kinetic_prefect.pod.runner import CheckpointSync

    monkeypatch.setenv("KINETIC_JOB_DIR", str(tmp_path / "job"))
    master, store = b"master", LocalStore(tmp_path / "store")
    key = "checkpoints/task-run-2"
    saver = CheckpointSync(store, key, signing_key=_job_ring(master, "run-1", key))
    saver.restore()
    (saver.dir / "a").mkdir()
    (saver.dir / "a" / "b.bin").write_bytes(b"bytes")
    (saver.dir / FILES_MANIFEST_NAME).write_text("{}")  # the function's file of that name is never uploaded
    saver.stop()
    store.put_bytes(f"{key}/planted.pkl", b"attacker")  # not in the manifest: not restored

    retry = CheckpointSync(store, key, signing_key=_job_ring(master, "run-2", key))
    assert retry.restore() == 1
    assert sorted(p.relative_to(retry.dir).as_posix() for p in retry.dir.rglob("*") if p.is_file()) == ["a/b.bin"]
    assert "planted.pkl" in capsys.readouterr().err

    another_task = _job_ring(master, "run-3", "checkpoints/another-task-run")  # a job of another task run
    with pytest.raises(signing.OutOfScope):
        CheckpointSync(store, key, signing_key=another_task).restore()

    store.delete(files_manifest_key(key) + signing.SUFFIX)  # an unsigned manifest
    with pytest.raises(signing.TamperedObject, match="no signature"):
        CheckpointSync(store, key, signing_key=_job_ring(master, "run-4", key)).restore()


@pytest.mark.no_server
def test_each_hosts_outputs_carry_their_own_manifest(tmp_path, monkeypatch):
    """A group's hosts upload under hosts/<i>/ with a manifest each; the caller lists and checks both."""
    from kinetic_prefect.errors import SigningKeyMissing, StoreTampered
    from kinetic_prefect.pod.runner import _upload_outputs

    master, store = b"master-key", LocalStore(tmp_path / "store")
    layout = RunLayout("run-g")
    ring = _job_ring(master, layout.run_id, "checkpoints/tr-g")
    for host in (0, 1):
        out = tmp_path / f"out{host}"
        (out / "sub").mkdir(parents=True)
        (out / "sub" / "log.txt").write_text(f"host {host}")
        assert _upload_outputs(store, layout, out, host, ring) == ["sub/log.txt"]
        assert store.exists(layout.host_outputs_manifest(host))

    monkeypatch.delenv("KINETIC_SIGNING_KEY", raising=False)
    outputs = JobOutputs(store=store.url, run_id=layout.run_id, signed=True)
    with pytest.raises(SigningKeyMissing, match="signed"):
        outputs.names()
    assert outputs.names(key=master) == ["hosts/1/sub/log.txt", "sub/log.txt"]
    assert outputs.download("hosts/1/sub/log.txt", tmp_path / "dl", key=master).read_text() == "host 1"
    store.put_bytes(f"{layout.host_outputs(1)}/sub/log.txt", b"forged")
    with pytest.raises(StoreTampered, match="hosts/1/sub/log.txt does not match"):
        outputs.download_all(tmp_path / "all", key=master)
    assert not (tmp_path / "all").exists()
    monkeypatch.setenv("KINETIC_SIGNING_KEY", "another-key")
    from kinetic_prefect.errors import SigningKeyMismatch

    with pytest.raises(SigningKeyMismatch):
        outputs.download("sub/log.txt", tmp_path / "dl2")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kinetic-download-")]


@pytest.mark.no_server
def test_outputs_without_a_signed_manifest_are_refused_with_a_key(tmp_path):
    """Files under outputs/<run>/ that no signed manifest lists (an unsigned job's, or the manifest deleted) are
    neither listed nor downloaded by a caller that holds the key."""
    from kinetic_prefect.errors import StoreTampered
    from kinetic_prefect.pod.runner import _upload_outputs

    store, layout = LocalStore(tmp_path / "store"), RunLayout("run-u")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.pkl").write_bytes(b"unsigned")
    assert _upload_outputs(store, layout, tmp_path / "out", 0, None) == ["model.pkl"]
    outputs = JobOutputs(store=store.url, run_id=layout.run_id)
    assert outputs.names() == ["model.pkl"]  # no key on either side: as the store has them
    with pytest.raises(StoreTampered, match="no signed manifest"):
        outputs.names(key=b"master")
    with pytest.raises(StoreTampered, match="not among the outputs"):
        outputs.download("model.pkl", tmp_path / "dl", key=b"master")
    assert not (tmp_path / "dl").exists()


def test_a_caller_whose_key_is_the_secret_block_checks_outputs_with_it(tmp_path, monkeypatch):
    """`kinetic-prefect up` keeps the key in the Prefect Secret block only: the key the flow's calls read from it
    is the one `JobOutputs.download` checks with (no KINETIC_SIGNING_KEY in the caller's environment)."""
    import asyncio

    from prefect.blocks.system import Secret

    from kinetic_prefect.caller import _prefect
    from kinetic_prefect.errors import StoreTampered
    from kinetic_prefect.pod import outputs as outputs_module
    from kinetic_prefect.pod.runner import _upload_outputs

    monkeypatch.delenv("KINETIC_SIGNING_KEY", raising=False)
    monkeypatch.setattr(outputs_module, "_caller_key", None)
    try:
        before = str(Secret.load(signing.SECRET_BLOCK).get())
    except ValueError:
        before = None
    secret = "block-key-" + uuid.uuid4().hex
    Secret(value=secret).save(signing.SECRET_BLOCK, overwrite=True)
    try:
        _prefect.forget_signing_key()
        assert asyncio.run(_prefect.signing_key()) is not None  # what a flow's first kinetic call does
        store, layout = LocalStore(tmp_path / "store"), RunLayout("run-b")
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "model.pkl").write_bytes(b"weights")
        ring = _job_ring(secret.encode(), layout.run_id, "checkpoints/tr-b")
        _upload_outputs(store, layout, tmp_path / "out", 0, ring)
        outputs = JobOutputs(store=store.url, run_id=layout.run_id, signed=True)
        assert outputs.download("model.pkl", tmp_path / "dl").read_bytes() == b"weights"
        store.put_bytes(layout.output("model.pkl"), b"forged")
        with pytest.raises(StoreTampered, match="does not match its signed manifest"):
            outputs.download("model.pkl", tmp_path / "dl2")
    finally:
        if before is None:
            Secret.delete(signing.SECRET_BLOCK)
        else:
            Secret(value=before).save(signing.SECRET_BLOCK, overwrite=True)
        _prefect.forget_signing_key()
