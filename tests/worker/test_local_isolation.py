"""Issue 54, finding 4, as a job's code would attack its kinetic-local worker: a job runs as the worker's user, and
read ``/proc/<worker pid>/environ`` (the master key ``KINETIC_SIGNING_KEY``, the worker's ``PREFECT_API_KEY``) or
was handed the worker's earlier master keys through a broad ``inherit_env``.

Now a polling worker makes itself non-dumpable before its first job (``launcher.close_to_jobs``), so a process of
its user without ``CAP_SYS_PTRACE`` is refused its environment and memory; and no job's environment holds a master
key, current or previous, or a Prefect credential, whatever the pool inherits. What stays open (the worker's files,
and everything to a job run as root) is what ``kinetic-prefect doctor`` says for a kinetic-local pool.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from types import SimpleNamespace

import pytest

from kinetic_prefect.contract import Env

SECRET = "worker-master-key-" + uuid.uuid4().hex
NOBODY = 65534

_TARGET = """
import sys
from kinetic_prefect.workers.local.launcher import close_to_jobs
closed = close_to_jobs() if sys.argv[1] == "close" else False
print("closed" if closed else "open", flush=True)
sys.stdin.read()  # until the test is done reading it
"""

_READER = """
import sys
pid = sys.argv[1]
for name in ("environ", "mem"):
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            print(name, "read", sys.argv[2].encode() in fh.read(65536) if name == "environ" else True)
    except OSError as exc:
        print(name, "refused", exc.errno)
"""


def _as_one_unprivileged_user(home: str) -> tuple[list[str], dict[str, str]]:
    """The prefix that runs a command as one user without CAP_SYS_PTRACE, as a job of the worker's user is: the
    current user, or ``nobody`` when the tests run as root (root reads any process)."""
    env = {**os.environ, "HOME": home, "PREFECT_HOME": os.path.join(home, ".prefect"), Env.SIGNING_KEY: SECRET}
    if os.geteuid() != 0:
        return [], env
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no unprivileged user to be")
    os.chown(home, NOBODY, NOBODY)
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"], env


@pytest.mark.no_server
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_DUMPABLE is Linux's")
@pytest.mark.parametrize("worker", ["open", "close"])
def test_a_process_of_the_worker_s_user_cannot_read_a_closed_worker(worker):
    """A stand-in worker (holding the key in its exec environment, as ``KINETIC_SIGNING_KEY=... prefect worker
    start`` does) and a reader of the same user: the reader gets the key from an open worker (the attack as it was)
    and nothing from one that ran ``close_to_jobs``. About 5 s: the worker imports the launcher (Prefect)."""
    home = tempfile.mkdtemp(prefix="kinetic-isolation-")
    try:
        prefix, env = _as_one_unprivileged_user(home)
        target = subprocess.Popen(
            [*prefix, sys.executable, "-c", _TARGET, worker],
            env=env,
            cwd=home,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert (
                target.stdout is not None
                and target.stdout.readline().strip() == {"open": "open", "close": "closed"}[worker]
            )
            reader_env = {k: v for k, v in env.items() if k != Env.SIGNING_KEY}
            read = subprocess.run(
                [*prefix, sys.executable, "-c", _READER, str(target.pid), SECRET],
                env=reader_env,
                cwd=home,
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            target.communicate("", timeout=30)
        assert read.returncode == 0, read.stderr
        seen = dict(line.split(" ", 1) for line in read.stdout.splitlines())
        if worker == "open":
            assert seen == {"environ": "read True", "mem": "read True"}, seen
        else:
            assert seen == {"environ": "refused 13", "mem": "refused 13"}, seen
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def inheriting_worker(prefect_server, tmp_path_factory):
    """A polling worker holding a master key, an earlier one and a Prefect API key in its exec environment, on a pool
    whose owner lets jobs inherit ``KINETIC_*`` and ``PREFECT_*`` (broad patterns). About 8 s to start."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolUpdate
    from worker_fixture import WorkerProcess, new_pool

    folder = tmp_path_factory.mktemp("isolation-worker")
    pool = new_pool("isolation")
    with get_client(sync_client=True) as client:
        template = client.read_work_pool(pool).base_job_template
        template["variables"]["properties"]["inherit_env"]["default"] = ["KINETIC_*", "PREFECT_*"]
        client.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))
    secrets = {
        Env.SIGNING_KEY: SECRET,
        Env.SIGNING_KEY_PREVIOUS: "earlier-master-key-" + uuid.uuid4().hex,
        "PREFECT_API_KEY": "pnu_worker_" + uuid.uuid4().hex[:12],
    }
    worker = WorkerProcess(pool, folder / "worker.log", {**secrets, Env.CACHE_DIR: str(folder / "cache")})
    worker.start()
    yield SimpleNamespace(pool=pool, secrets=secrets)
    worker.stop()


@pytest.mark.slow
def test_a_kinetic_local_job_reaches_none_of_its_worker_s_keys(inheriting_worker, monkeypatch):
    """The job's code lists its environment and reads its parent's (the worker's) ``/proc/<ppid>/environ``. Neither
    the master key, the earlier one nor the API key is in its environment; the worker's own environment is refused
    to it, unless the job runs as root, which reads any process: the case ``doctor`` names. About 20 s."""
    from prefect import flow

    from kinetic_prefect import kinetic_task

    monkeypatch.setenv(Env.SIGNING_KEY, SECRET)

    @kinetic_task(
        name=f"isolation-{uuid.uuid4().hex[:6]}",
        work_pool=inheriting_worker.pool,
        submission="worker",
        job_variables={"keep_warm_seconds": 0},
    )
    def snoop() -> dict:
        import os

        try:
            with open(f"/proc/{os.getppid()}/environ", "rb") as fh:
                parent = fh.read().decode(errors="replace")
        except OSError as exc:
            parent = f"refused {exc.errno}"
        return {"env": dict(os.environ), "parent": parent, "root": os.geteuid() == 0}

    @flow
    def pipeline() -> dict:
        return snoop()

    seen = pipeline()
    env = seen["env"]
    for name, value in inheriting_worker.secrets.items():
        assert not [k for k, v in env.items() if value in v], f"the worker's {name} reached the job"
    assert Env.SIGNING_KEY_PREVIOUS not in env and "PREFECT_API_KEY" not in env, sorted(env)
    if seen["root"]:
        assert SECRET in seen["parent"], "a job run as root reads the worker's environment: doctor says so"
    else:
        assert seen["parent"] == "refused 13", seen["parent"][:200]


@pytest.mark.no_server
def test_doctor_says_what_a_kinetic_local_job_can_still_reach() -> None:
    from kinetic_prefect.shared.doctor import WARN, Report
    from kinetic_prefect.workers.local.doctor import ISOLATION, doctor

    report = Report(pool="local")
    doctor(report, None, None, [])
    [check] = [c for c in report.checks if c.name == ISOLATION]
    assert check.status == WARN and report.ok
    assert "worker's user" in check.detail and "PREFECT_HOME" in check.detail
    assert "a user of its own" in check.fix and "kinetic-gke" in check.fix
