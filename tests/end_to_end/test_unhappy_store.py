"""Unhappy paths around the store and the job's own process (issue 21, defects 2, 5, 6 and 9).

Every test goes through real jobs: a Prefect server, the runner as a separate process, a polling worker
process where the path says so.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from worker_fixture import new_pool

from kinetic_prefect import Data, kinetic_task


def job_runs(task_name: str):
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[task_name])))


# --------------------------------------------------------------------------- defect 2: a private working directory


@pytest.mark.slow
def test_a_job_that_rewrites_its_code_or_leaves_junk_does_not_reach_the_next_job(tmp_path):
    from kinetic_prefect.pod.runner import _node_cache

    module = f"helper_{uuid.uuid4().hex[:8]}"
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'vandal'\nversion = '0'\n")
    (project / f"{module}.py").write_text("VALUE = 'original'\n")
    name = f"vandal-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, project_dir=project, submission="in-process")
    def look(vandalize: bool) -> dict:
        import importlib
        import os as _os
        import pathlib

        helper = importlib.import_module(module)
        seen = {"value": helper.VALUE, "junk": pathlib.Path("junk.txt").exists(), "cwd": _os.getcwd()}
        if vandalize:
            pathlib.Path(f"{module}.py").write_text("VALUE = 'rewritten'\n")
            pathlib.Path("junk.txt").write_text("junk")
        return seen

    @flow
    def pipeline():
        return look(True), look(False)

    first, second = pipeline()
    assert first["value"] == "original"
    assert second == {**second, "value": "original", "junk": False}, second
    assert first["cwd"] != second["cwd"], "two calls shared one working directory"
    assert not Path(first["cwd"]).exists(), "the first job's working copy was left behind"
    # The node's shared copy of the project is as the caller shipped it.
    copies = [p for p in (_node_cache() / "code").glob(f"*/{module}.py")]
    assert copies, "the project was not unpacked into the node cache"
    for copy in copies:
        assert copy.read_text() == "VALUE = 'original'\n", copy
        assert not (copy.parent / "junk.txt").exists()


# --------------------------------------------------------------------------- defect 5: exceptions keep their state


def _raise(kind: str) -> None:
    import subprocess as _subprocess
    import sys as _sys

    if kind == "oserror":
        raise FileNotFoundError(2, "No such file", "/x/y")
    if kind == "open":
        with open("/nonexistent-kinetic-dir/file.txt"):  # raises: the folder does not exist
            pass
    if kind == "keyerror":
        raise KeyError("missing-key")
    if kind == "unicode":
        b"ab\xff".decode("utf-8")
    if kind == "called":
        _subprocess.run(
            [_sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], check=True, capture_output=True, text=True
        )
    if kind == "group":
        raise ExceptionGroup("two failures", [ValueError("a"), PermissionError(13, "Permission denied", "/etc/z")])


def _describe(exc: BaseException) -> dict:
    seen = {"type": type(exc).__name__, "args": repr(exc.args)}
    for attr in (
        "errno",
        "strerror",
        "filename",
        "encoding",
        "object",
        "start",
        "end",
        "reason",
        "returncode",
        "cmd",
        "output",
        "stderr",
    ):
        if hasattr(exc, attr):
            seen[attr] = getattr(exc, attr)
    if isinstance(exc, BaseExceptionGroup):
        seen["message"] = exc.message
        seen["exceptions"] = [_describe(inner) for inner in exc.exceptions]
    return seen


KINDS = ["oserror", "open", "keyerror", "unicode", "called", "group"]


@pytest.fixture(scope="module")
def remote_exceptions(prefect_server) -> dict:
    """Each kind raised in a real job, and the same exception raised here: what the caller's copy holds."""
    name = f"raises-{uuid.uuid4().hex[:6]}"
    raise_here = _raise

    @kinetic_task(name=name, submission="in-process")
    def boom(kind: str) -> None:
        raise_here(kind)

    @flow
    def pipeline() -> dict:
        seen = {}
        for kind in KINDS:
            try:
                boom(kind)
            except BaseException as exc:  # noqa: BLE001 - what the caller gets is the subject
                seen[kind] = _describe(exc)
        return seen

    remote = pipeline()
    local = {}
    for kind in KINDS:
        try:
            _raise(kind)
        except BaseException as exc:  # noqa: BLE001
            local[kind] = _describe(exc)
    return {"remote": remote, "local": local}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_a_remote_exception_keeps_its_constructor_state(remote_exceptions, kind):
    remote, local = remote_exceptions["remote"][kind], remote_exceptions["local"][kind]
    assert remote == local


# --------------------------------------------------------------------------- defect 9: errors that say what is wrong


@pytest.mark.slow
def test_a_worker_with_another_signing_key_is_named_as_such(worker_factory, monkeypatch):
    from kinetic_prefect.caller import _prefect

    monkeypatch.setenv("KINETIC_SIGNING_KEY", "worker-key-" + uuid.uuid4().hex)
    worker = worker_factory().start()
    monkeypatch.setenv("KINETIC_SIGNING_KEY", "caller-key-" + uuid.uuid4().hex)
    _prefect.forget_signing_key()
    name = f"keys-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=worker.pool, submission="worker")
    def one() -> int:
        return 1

    @flow
    def pipeline():
        return one()

    with pytest.raises(Exception, match="the worker's signing key differs from the caller's") as caught:
        pipeline()
    assert "changed in the store" not in str(caught.value)
    [run] = job_runs(name)
    assert run.state.is_failed(), run.state
    assert "signing key differs" in run.state.message


def test_a_lambda_is_named_before_anything_is_created():
    with pytest.raises(ValueError, match=r"lambda.*name=") as caught:
        kinetic_task(lambda x: x * 2)
    assert "test_unhappy_store.py" in str(caught.value), "the message says which lambda"
    with pytest.raises(ValueError, match="name='a/b'"):
        kinetic_task(name="a/b")(lambda x: x)
    named = kinetic_task(name=f"double-{uuid.uuid4().hex[:6]}", submission="in-process")(lambda x: x * 2)
    with pytest.raises(ValueError, match="name='c<d'"):
        named.with_options(name="c<d")

    @flow
    def pipeline():
        return named(21)

    assert pipeline() == 42


@pytest.fixture
def small_store(tmp_path):
    """A store directory on a 3 MiB tmpfs of its own (the test runs as root; skipped where mounting is refused)."""
    mount = tmp_path / "small-store"
    mount.mkdir()
    probe = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_store_while_writing_the_result_names_enospc_and_is_not_retried(small_store):
    from kinetic_prefect.cli.doctor import set_pool_variables

    pool = new_pool("full")
    set_pool_variables(pool, [f"store={small_store}"])
    name = f"full-{uuid.uuid4().hex[:6]}"

    @kinetic_task(
        name=name, work_pool=pool, submission="in-process", ship_project=False, retries=2, retry_delay_seconds=0
    )
    def big() -> bytes:
        return os.urandom(4 * 2**20)  # more than the 3 MiB store holds

    @flow
    def pipeline():
        return big()

    with pytest.raises(Exception, match=r"ENOSPC.*" + str(small_store)) as caught:
        pipeline()
    assert type(caught.value).__name__ == "StoreFull", caught.value
    runs = job_runs(name)
    assert len(runs) == 1, f"a full store was retried {len(runs) - 1} times"
    assert runs[0].state.is_failed(), runs[0].state
    assert "ENOSPC" in runs[0].state.message


def test_a_full_store_while_the_caller_uploads_is_store_full_and_is_not_retried(small_store):
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    from kinetic_prefect.cli.doctor import set_pool_variables

    pool = new_pool("fullup")
    set_pool_variables(pool, [f"store={small_store}"])
    name = f"fullup-{uuid.uuid4().hex[:6]}"

    @kinetic_task(
        name=name, work_pool=pool, submission="in-process", ship_project=False, retries=2, retry_delay_seconds=0
    )
    def takes(blob: bytes) -> int:
        return len(blob)

    @flow
    def pipeline():
        return takes(os.urandom(4 * 2**20))  # an argument larger than the 3 MiB store holds

    with pytest.raises(Exception, match=r"ENOSPC.*" + str(small_store)) as caught:
        pipeline()
    assert type(caught.value).__name__ == "StoreFull", caught.value
    assert "payload" in str(caught.value), "the message names what was being uploaded"
    assert job_runs(name) == [], "nothing is launched"
    with get_client(sync_client=True) as client:
        [task_run] = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)))
    assert task_run.run_count == 1, f"a full store was retried {task_run.run_count - 1} times"
    assert [p for p in small_store.rglob("*") if p.is_file()] == [], "the torn upload is removed"


# --------------------------------------------------------------------------- defect 6: damaged Data heals


@pytest.fixture(params=["in-process", "worker"])
def signed_route(request, worker_factory, monkeypatch):
    monkeypatch.setenv("KINETIC_SIGNING_KEY", "data-key")
    from kinetic_prefect.caller import _prefect

    _prefect.forget_signing_key()
    if request.param == "worker":
        return worker_factory().start().pool, "worker"
    return new_pool("inproc"), "in-process"


@pytest.mark.slow
def test_a_damaged_data_object_is_healed_from_the_callers_copy(signed_route, store_dir, tmp_path):
    pool, submission = signed_route
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    token = uuid.uuid4().hex
    for index in range(3):
        (dataset / f"part-{index}.txt").write_text(f"{token} part {index}\n")
    name = f"heal-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool, submission=submission, ship_project=False)
    def read_all(folder) -> list[str]:
        import pathlib

        return [p.read_text() for p in sorted(pathlib.Path(folder).iterdir())]

    @flow
    def pipeline():
        return read_all(Data(dataset))

    expected = [f"{token} part {index}\n" for index in range(3)]
    assert pipeline() == expected
    [stored] = [p for p in (store_dir / "data").glob("*/files/part-1.txt") if p.read_text() == expected[1]]
    stored.write_text("damaged\n")
    assert pipeline() == expected, "a damaged Data object was not healed"
    assert stored.read_text() == expected[1]
    assert pipeline() == expected


@pytest.mark.slow
def test_a_damaged_data_object_in_a_bucket_heals_for_the_retry(gcs_bucket, tmp_path, monkeypatch):
    """On a gs:// store the job finds the damage (it checks what it downloads); the caller then uploads the
    dataset again from its own copy, so the task's retry runs with a good one."""
    from prefect.client.schemas.actions import WorkPoolCreate

    from kinetic_prefect.storage import open_store
    from kinetic_prefect.workers.base import load_template

    store_url = f"{gcs_bucket}/kinetic"
    pool = f"gcs-heal-{uuid.uuid4().hex[:6]}"
    template = load_template("kinetic-local")
    template["variables"]["properties"]["store"]["default"] = store_url
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="kinetic-local", base_job_template=template))
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    expected = [f"{uuid.uuid4().hex} part {index}\n" for index in range(3)]
    for index, text in enumerate(expected):
        (dataset / f"part-{index}.txt").write_text(text)
    name = f"heal-gcs-{uuid.uuid4().hex[:6]}"

    @kinetic_task(
        name=name, work_pool=pool, submission="in-process", ship_project=False, retries=1, retry_delay_seconds=0
    )
    def read_all(folder) -> list[str]:
        import pathlib

        return [p.read_text() for p in sorted(pathlib.Path(folder).iterdir())]

    @flow
    def pipeline():
        return read_all(Data(dataset))

    assert pipeline() == expected
    store = open_store(store_url)
    [key] = [k for k in store.list("data/") if k.endswith("/files/part-1.txt")]
    store.put_bytes(key, b"damaged\n")
    monkeypatch.setenv("KINETIC_NODE_CACHE", str(tmp_path / "another-node"))  # a node that has not downloaded it
    assert pipeline() == expected, "the retry did not get a healed copy"
    assert store.get_bytes(key) == expected[1].encode()
    runs = job_runs(name)
    assert len(runs) == 3 and sum(r.state.is_failed() for r in runs) == 1, [r.state for r in runs]
