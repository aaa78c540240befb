"""Issue 45, findings 1 and 3, written as the attackers run them: a store writer (or a local user who can write a
warm runner's control folder) hands a warm runner a call of their own; code inside one job signs a result for
another user's run. Each is refused, and the attacker's pickle never runs.

The warm-pod cases start the real warm runner process (``python -m kinetic_prefect.pod.warm_runner``), as a GKE
pod's container does, against a local store: a few seconds each."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow

from kinetic_prefect import kinetic_task, signing
from kinetic_prefect.contract import Env, RunLayout, WarmPodKeys, WarmRunnerFiles


class _Boom:
    """Unpickling this writes a file: stands in for the code a forged pickle runs."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path(self.path).write_text, ("pwned",))


def _wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {seconds}s waiting for {what}")


def _plant_payload(store_dir: Path, run_id: str, proof: Path) -> str:
    """The attacker's own 'call': a payload that runs code when unpickled, and its sha256."""
    blob = pickle.dumps(_Boom(str(proof)))
    payload = store_dir / RunLayout(run_id).payload
    payload.parent.mkdir(parents=True, exist_ok=True)
    payload.write_bytes(blob)
    return hashlib.sha256(blob).hexdigest()


def _forged_env(run_id: str, sha: str) -> dict[str, str]:
    return {
        Env.SIGNING_KEY: "",
        Env.SIGNED: "",
        Env.RUN_ID: run_id,
        Env.PAYLOAD_SHA256: sha,
    }


def _runner_env(store_dir: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KINETIC_")}
    return {**env, Env.STORE: str(store_dir), Env.SIGNED: "1", **extra}


def test_a_store_writer_cannot_hand_a_warm_pod_a_call(tmp_path):
    """Finding 1 (GKE): the attacker sees ``ready-1`` and writes ``call-1.json`` with an environment that empties
    the key and names their own payload. The pod refuses the record (it is not signed with the pod's scope key),
    runs nothing of it, and leaves."""
    store_dir, proof = tmp_path / "store", tmp_path / "proof"
    store_dir.mkdir()
    master = signing.Keyring([b"master-" + uuid.uuid4().hex.encode()])
    control = WarmPodKeys.control("envkey", "kinetic-warm-pod")
    first = "first" + uuid.uuid4().hex[:8]
    keys = master.for_job(*signing.run_scopes(first), signing.scope_of(control + "/x"))
    env = _runner_env(
        store_dir,
        {
            Env.WARM_CONTROL: control,
            Env.WARM_KEEP_SECONDS: "30",
            Env.RUN_ID: first,  # no payload: the first call fails at once, and the pod waits for call 1
            Env.PAYLOAD_SHA256: "0" * 64,
            Env.SIGNING_KEY: keys.to_env(),
        },
    )
    pod = subprocess.Popen(
        [sys.executable, "-m", "kinetic_prefect.pod.warm_runner"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        ready = store_dir / control / WarmPodKeys.ready(1)
        _wait_for(ready.exists, 60, "the pod's ready-1 record")
        victim = "x" + uuid.uuid4().hex[:8]
        sha = _plant_payload(store_dir, victim, proof)
        call = store_dir / control / WarmPodKeys.call(1)
        call.write_text(json.dumps({"env": _forged_env(victim, sha)}))
        out, _ = pod.communicate(timeout=60)
    finally:
        pod.kill()
    assert not proof.exists(), "the warm pod unpickled a payload a store writer handed it"
    assert "refused call" in out and "no signature" in out, out
    assert not (store_dir / RunLayout(victim).warm_exit).exists(), "the forged call ran"


def test_a_local_user_cannot_hand_a_warm_runner_a_call(tmp_path):
    """Finding 1 (kinetic-local): whoever can write an idle runner's control folder writes ``call.json`` with an
    environment of their own. The runner checks the record's signature under its own scope and refuses it."""
    store_dir, proof = tmp_path / "store", tmp_path / "proof"
    store_dir.mkdir()
    master = signing.Keyring([b"master-" + uuid.uuid4().hex.encode()])
    from kinetic_prefect.pod.warm_runner import local_call_key

    control = tmp_path / "warm" / "envkey" / "runner1"
    control.mkdir(parents=True)
    runner_keys = master.for_job(signing.scope_of(local_call_key(control)))
    env = _runner_env(store_dir, {Env.SIGNING_KEY: runner_keys.to_env(), Env.WARM_LAUNCHER_PID: str(os.getpid())})
    runner = subprocess.Popen(
        [sys.executable, "-m", "kinetic_prefect.pod.warm_runner", str(control)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        victim = "x" + uuid.uuid4().hex[:8]
        sha = _plant_payload(store_dir, victim, proof)
        job_dir = tmp_path / "job"
        job_dir.mkdir()
        forged = {**_runner_env(store_dir, {}), **_forged_env(victim, sha)}
        call = {"job_dir": str(job_dir), "log": "job.log", "env": forged, "keep_warm_seconds": 0}
        (control / WarmRunnerFiles.CALL).write_text(json.dumps(call))
        exit_status = job_dir / WarmRunnerFiles.EXIT_STATUS
        _wait_for(exit_status.exists, 60, "the runner's answer to the forged call")
    finally:
        runner.kill()
        runner.communicate(timeout=30)
    assert not proof.exists(), "the warm runner unpickled a payload a local user handed it"
    assert "refused" in (job_dir / "job.log").read_text()


@pytest.mark.slow
def test_code_in_one_job_cannot_sign_another_runs_result(store_dir, tmp_path, monkeypatch):
    """Finding 3: the attacker's task reads ``KINETIC_SIGNING_KEY`` in its job and signs a forged result for the
    victim's run with every key it finds there. On today's main that was the master key, so the victim's caller
    unpickled the forgery; now a job holds only its own run's derived keys and the forgery is refused. The master
    key is nowhere in the job's environment. (Two calls through the embedded server and the local worker.)"""

    master = "master-" + uuid.uuid4().hex
    monkeypatch.setenv("KINETIC_SIGNING_KEY", master)
    proof = tmp_path / "proof"
    victim_run = "victim" + uuid.uuid4().hex[:8]
    victim_result = RunLayout(victim_run).result

    @kinetic_task(name=f"attacker-{uuid.uuid4().hex[:6]}")
    def attacker(object_key: str, proof_path: str) -> dict:
        import hashlib as _hashlib
        import hmac as _hmac
        import os as _os
        import pickle as _pickle

        held = _os.environ["KINETIC_SIGNING_KEY"]
        blob = _pickle.dumps(_Boom(proof_path))
        candidates = [held.encode()]  # the value as a key (a master key, on the main of its day)
        if held.startswith("kinetic-scoped-v1:"):  # every key of the job's own keyring
            candidates = [
                bytes.fromhex(v)
                for k, _, v in (i.partition("=") for i in held.split(":", 1)[1].split(";"))
                if k != "@id"
            ]
        from kinetic_prefect import signing as _signing

        signatures = []
        for key in candidates:
            for mac_key in (key, _signing.derive(key, _signing.scope_of(object_key))):
                mac = _hmac.new(mac_key, object_key.encode() + b"\0" + blob, _hashlib.sha256).hexdigest()
                signatures.append(f"{mac} key:{_signing.key_id(key)}")
        return {"env": held, "blob": blob, "signatures": signatures}

    @flow
    def attack():
        return attacker(victim_result, str(proof))

    stolen = attack()
    assert master not in stolen["env"], "the master key reached a job"
    ring = signing.parse_keys(master)
    accepted = []
    for signature in stolen["signatures"]:
        try:
            signing.check(ring, victim_result, stolen["blob"], signature.encode(), victim_result)
            accepted.append(signature)
        except signing.TamperedObject:
            pass
    assert not accepted, "a job signed an object of another run that the caller accepts"
    assert not proof.exists()


def test_a_blank_key_is_refused_not_read_as_unsigned(monkeypatch):
    """Finding 1's other half: ``KINETIC_SIGNING_KEY=""`` is an error, never "no key, so check nothing"."""
    from kinetic_prefect.contract.settings import SettingError

    monkeypatch.setenv("KINETIC_SIGNING_KEY", "  ")
    with pytest.raises((SettingError, signing.BadKey), match="KINETIC_SIGNING_KEY"):
        signing.key_from_env()


def test_a_job_keyring_signs_its_own_scopes_only_and_rotation_keeps_old_objects_valid():
    master = signing.Keyring([b"new-key", b"old-key"])
    old = signing.Keyring([b"old-key"])
    job = signing.parse_keys(master.for_job(*signing.run_scopes("r1", "checkpoints/t1")).to_env())
    assert job is not None and not job.is_master
    for own in ("runs/r1/result.pkl", "outputs/r1/model.keras", "checkpoints/t1/step.pt"):
        signing.check(master, own, b"v", signing.sign(job, own, b"v"), own)
    for other in ("runs/r2/result.pkl", "outputs/r2/a", "checkpoints/t2/a", "data/abc/manifest.json", "results/x"):
        with pytest.raises(signing.OutOfScope):
            signing.sign(job, other, b"v")
    signed_by_old = signing.sign(old, "results/r", b"v")
    assert signing.check(master, "results/r", b"v", signed_by_old, "r") == b"v"  # verified by a previous key
    assert signing.sign(master, "results/r", b"v") != signed_by_old  # signed with the first
    grant = master.grant(signing.run_scopes("r2"), under="warm/e/p", nonce="warm/e/p/call-1.json")
    pod = master.for_job("warm/e/p")
    taken = pod.accept(grant, under="warm/e/p", nonce="warm/e/p/call-1.json")
    signing.check(master, "runs/r2/result.pkl", b"v", signing.sign(taken, "runs/r2/result.pkl", b"v"), "r2")
    wrong_nonce = pod.accept(grant, under="warm/e/p", nonce="warm/e/p/call-2.json")
    with pytest.raises(signing.TamperedObject):
        signing.check(master, "runs/r2/result.pkl", b"v", signing.sign(wrong_nonce, "runs/r2/result.pkl", b"v"), "")
