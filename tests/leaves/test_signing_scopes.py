"""Issue 54, findings 5 and 6: what a job's keyring and a rotated-out key can sign.

Finding 5: ``signing.scope_of`` reads ``runs/runs``, ``sweeps/left``, ``results/x`` and ``checkpoints/left`` as the
store's own scope, and ``for_job`` handed that key over: a job run with ``KINETIC_SWEEP_ID=runs`` or
``KINETIC_CHECKPOINT_KEY=results/x`` held the key that signs job variables for any run (and Prefect's result
records). Now a job never gets the store scope, and run ids, sweep ids and checkpoint keys are checked as ids.

Finding 6: during a rotation the previous key verified everything, so whoever still held it (the reason to rotate)
signed brand-new job variables, payloads and hand-overs. Now previous keys verify only what outlives a call and was
made before the rotation: Prefect result records (``results/``), Data manifests (``data/``), checkpoints and
outputs. Everything that starts or hands over a job verifies under the current key only.
"""

from __future__ import annotations

import pytest

from kinetic_prefect import signing
from kinetic_prefect.contract import Env, RunLayout, SweepKeys
from kinetic_prefect.workers.local.configuration import KineticLocalJobConfiguration

pytestmark = pytest.mark.no_server

MASTER = b"the-pools-master-key"


def _jobs_keyring(env: dict[str, str]) -> signing.Keyring:
    """What the worker hands a job whose variables say ``env``, read back as the job reads it."""
    configuration = KineticLocalJobConfiguration(env=env)
    configuration.hand_over_signing_keys(signing.Keyring([MASTER]))
    ring = signing.parse_keys(configuration.secret_env[Env.SIGNING_KEY])
    assert ring is not None
    return ring


@pytest.mark.parametrize(
    "env",
    [
        {Env.RUN_ID: "r1", Env.SWEEP_ID: "runs"},
        {Env.RUN_ID: "r1", Env.SWEEP_ID: "left"},
        {Env.RUN_ID: "r1", Env.CHECKPOINT_KEY: "results/x"},
        {Env.RUN_ID: "r1", Env.CHECKPOINT_KEY: "checkpoints/left"},
        {Env.RUN_ID: "runs"},
        {Env.RUN_ID: "r1", Env.SWEEP_ID: "other/../x"},
    ],
    ids=["sweep-runs", "sweep-left", "checkpoint-results", "checkpoint-left", "run-runs", "sweep-path"],
)
def test_a_job_never_gets_the_store_scope(env) -> None:
    """The attacker's variables are refused when the keys are handed over; nothing the worker hands a job signs job
    variables for another run (the worker would run them)."""
    try:
        ring = _jobs_keyring(env)
    except (signing.BadKey, signing.OutOfScope) as exc:
        assert "id" in str(exc) or "store scope" in str(exc), exc
        return
    forged = {"env": {Env.RUN_ID: "victim", Env.PAYLOAD_SHA256: "0" * 64}}
    with pytest.raises(signing.OutOfScope):
        signing.sign_job_variables(ring, forged)
        signing.check_job_variables(signing.Keyring([MASTER]), forged)  # what the worker would accept
        pytest.fail(f"a job run with {env} signed job variables the worker accepts")


def test_a_job_of_our_own_still_gets_its_scopes() -> None:
    ring = _jobs_keyring({Env.RUN_ID: "run-1", Env.CHECKPOINT_KEY: "checkpoints/tr-1", Env.SWEEP_ID: "sw-1"})
    assert sorted(ring.scoped) == ["checkpoints/tr-1", "outputs/run-1", "runs/run-1", "sweeps/sw-1"]
    with pytest.raises(signing.OutOfScope):
        signing.Keyring([MASTER]).for_job(signing.STORE_SCOPE)


def test_a_rotated_out_key_signs_nothing_new() -> None:
    """After the rotation (new key first, the old one as previous), what the old key signs now is refused where it
    would start or hand over a job, and what it signed before still verifies where it outlives a call."""
    old, new = b"old-key", b"new-key"
    rotated = signing.Keyring([new, old])
    job_variables = {"env": {Env.RUN_ID: "r9", Env.PAYLOAD_SHA256: "0" * 64}}
    signing.sign_job_variables(signing.Keyring([old]), job_variables)
    with pytest.raises(signing.KeyMismatch, match="previous signing key"):  # a key to fix: the call is not retried
        signing.check_job_variables(rotated, job_variables)
    short_lived = [RunLayout("r9").payload, SweepKeys("s9").queued(1, "r9"), "warm/env/pod-1/call-1.json"]
    for object_key in short_lived:
        signature = signing.sign(old, object_key, b"x")
        with pytest.raises(signing.TamperedObject):
            signing.check(rotated, object_key, b"x", signature, object_key)
    long_lived = ["results/3f2a", "data/" + "a" * 64, "checkpoints/tr-9/manifest.json", "outputs/r9/model.pkl"]
    for object_key in long_lived:
        assert signing.check(rotated, object_key, b"x", signing.sign(old, object_key, b"x"), object_key) == b"x"
    # and the current key signs and verifies all of it
    for object_key in [*short_lived, *long_lived]:
        assert signing.check(rotated, object_key, b"x", signing.sign(rotated, object_key, b"x"), object_key) == b"x"
