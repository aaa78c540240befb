"""Worker side, ``kinetic-local``: the job is a local process in a hash-keyed environment.

The embedded default. It runs exactly what a pod would run (``python -m kinetic_prefect.runner``
with the same ``KINETIC_*`` environment), so a flow that works here works on GKE.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import anyio
from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import InfrastructureNotFound
from prefect.workers.base import BaseWorker
from pydantic import Field

from kinetic_prefect import config
from kinetic_prefect.image import ImageSpec, runner_digest, runner_sources
from kinetic_prefect.workers.base import KineticJobConfiguration, KineticWorkerMixin, KineticWorkerResult, load_template



class EnvironmentBuildError(RuntimeError):
    pass


def _uv_binary() -> str:
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if not found:
            raise EnvironmentBuildError("uv is needed to build job environments: pip install uv") from None
        return found


class LocalEnvironments:
    """uv virtual environments under ``<cache>/envs/<ImageSpec.tag>``: built once, reused after."""

    def __init__(self, root: Path | None = None):
        self.root = root or config.cache_dir() / "envs"
        self.builds = 0  # observable in tests: zero builds when nothing changed

    def python_for(self, spec: ImageSpec, log: Callable[[str], None] = print, store_url: str = "") -> str:
        if spec.uses_caller_interpreter:
            return sys.executable
        # The runner needs the store's client library; it is part of the environment, not of the tag.
        runtime = ("google-cloud-storage>=2.18",) if store_url.startswith("gs://") else ()
        env_dir = self.root / (spec.tag + ("-gcs" if runtime else ""))
        python = env_dir / "bin" / "python"
        if not (env_dir / ".kinetic-complete").exists():
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / f"{env_dir.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per tag; the others wait, then reuse
                if not (env_dir / ".kinetic-complete").exists():
                    self._build(spec, env_dir, log, runtime)
        self._sync_runner(python)
        return str(python)

    def _build(self, spec: ImageSpec, env_dir: Path, log: Callable[[str], None], runtime: tuple[str, ...]) -> None:
        import cloudpickle

        shutil.rmtree(env_dir, ignore_errors=True)  # a half-built env from a crashed build
        uv = _uv_binary()
        log(f"Building job environment {spec.tag} ({len(spec.requirements)} requirements)")
        requirements = [*spec.requirements, *runtime, f"cloudpickle=={cloudpickle.__version__}"]
        for cmd in (
            [uv, "venv", "--quiet", "--python", spec.python, str(env_dir)],
            [uv, "pip", "install", "--quiet", "--python", str(env_dir / "bin" / "python"), *requirements],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                shutil.rmtree(env_dir, ignore_errors=True)
                raise EnvironmentBuildError(
                    f"building environment {spec.tag} failed at `{shlex.join(cmd[1:4])} ...`:\n{proc.stderr[-3000:]}"
                )
        self.builds += 1
        (env_dir / ".kinetic-complete").write_text("\n".join(spec.requirements) + "\n")

    @staticmethod
    def _sync_runner(python: Path) -> None:
        stamp = runner_digest()
        lib = next((python.parent.parent / "lib").glob("python3*/site-packages"))
        target = lib / "kinetic_prefect"
        if (target / ".stamp").exists() and (target / ".stamp").read_text() == stamp:
            return
        target.mkdir(exist_ok=True)
        for name, blob in runner_sources().items():
            (lib / name).write_bytes(blob)
        (target / ".stamp").write_text(stamp)


class KineticLocalJobConfiguration(KineticJobConfiguration):
    working_dir: str | None = Field(default=None)
    stream_output: bool = Field(default=True)


class LocalJobLauncher:
    """Starts the runner as a child process and forwards its output line by line."""

    def __init__(self, environments: LocalEnvironments | None = None):
        self.environments = environments or LocalEnvironments()

    def command(self, configuration: KineticLocalJobConfiguration, log: Callable[[str], None]) -> list[str]:
        python = self.environments.python_for(configuration.image_spec, log, configuration.env.get("KINETIC_STORE", ""))
        argv = shlex.split(configuration.command or "python -u -m kinetic_prefect.runner")
        if argv and argv[0] in ("python", "python3"):
            argv[0] = python
        return argv

    async def launch(self, configuration: KineticLocalJobConfiguration, on_line: Callable[[str], None],
                     on_started: Callable[[int], Any]) -> int:
        argv = await anyio.to_thread.run_sync(self.command, configuration, on_line)
        env = {**os.environ, **{k: v for k, v in configuration.env.items() if v is not None}, **configuration.secret_env}
        env["PYTHONUNBUFFERED"] = "1"
        process = await asyncio.create_subprocess_exec(
            *argv, cwd=configuration.working_dir or None, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # so cancellation can signal the whole job, not just the runner
        )
        on_started(process.pid)
        try:
            assert process.stdout is not None
            async for raw in process.stdout:
                if configuration.stream_output:
                    on_line(raw.decode(errors="replace").rstrip("\n"))
            return await process.wait()
        finally:
            if process.returncode is None:  # the caller was cancelled: do not leave the job running
                _kill_group(process.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except asyncio.TimeoutError:
                    _kill_group(process.pid, signal.SIGKILL)


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


class KineticLocalWorker(KineticWorkerMixin, BaseWorker):
    type = "kinetic-local"
    job_configuration = KineticLocalJobConfiguration
    _description = "Runs @kinetic_task jobs as local processes in hash-keyed uv environments."
    _documentation_url = "https://github.com/kinetic-prefect/kinetic-prefect"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.launcher = LocalJobLauncher()

    @classmethod
    def get_default_base_job_template(cls) -> dict[str, Any]:
        return load_template(cls.type)

    async def run(self, flow_run: FlowRun, configuration: KineticLocalJobConfiguration,
                  task_status: anyio.abc.TaskStatus[int] | None = None) -> KineticWorkerResult:
        logger = self.get_flow_run_logger(flow_run)
        await configuration.load_secret_env()
        started: list[int] = []

        def on_started(pid: int) -> None:
            started.append(pid)
            if task_status is not None:
                task_status.started(pid)

        await self.mark_running(flow_run, f"Local job for accelerator {configuration.accelerator!r}")
        cancelled = False
        async with anyio.create_task_group() as group:
            async def watch() -> None:
                nonlocal cancelled
                while not await self.cancellation_requested(flow_run):
                    await anyio.sleep(1)
                cancelled = True
                group.cancel_scope.cancel()  # the launcher kills the job's process group on cancellation

            async def launch() -> None:
                nonlocal exit_code
                exit_code = await self.launcher.launch(configuration, logger.info, on_started)
                group.cancel_scope.cancel()

            exit_code = -1
            group.start_soon(watch)
            group.start_soon(launch)
        if cancelled:
            await self.mark_cancelled(flow_run, "Local job stopped on request")
            return KineticWorkerResult(identifier=str(started[0]) if started else "not-started", status_code=0)
        identifier = str(started[0]) if started else "not-started"
        if exit_code != 0:
            logger.error(f"Job process {identifier} exited with status {exit_code}")
        return await self.finish_from_outcome(flow_run, configuration, exit_code, identifier)

    async def kill_infrastructure(self, infrastructure_pid: str, configuration, grace_seconds: int = 30) -> None:
        try:
            pid = int(str(infrastructure_pid).rsplit(":", 1)[-1])
            os.killpg(pid, signal.SIGTERM)
        except (ValueError, ProcessLookupError):
            raise InfrastructureNotFound(f"no local job process {infrastructure_pid}") from None
