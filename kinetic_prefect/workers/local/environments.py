"""The hash-keyed uv environments local jobs run in (one per ``ImageSpec`` tag, with the runner's modules
copied in), and what a local job takes from the machine's environment."""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kinetic_prefect import config
from kinetic_prefect.contract import Env
from kinetic_prefect.shared.image import ImageSpec, runner_digest, runner_sources


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
        from kinetic_prefect.pod import progress

        log(f"Building job environment {spec.tag} ({len(spec.requirements)} requirements)")
        requirements = [*spec.requirements, *runtime, f"cloudpickle=={cloudpickle.__version__}"]
        steps = (
            ("creating the virtual environment", [uv, "venv", "--quiet", "--python", spec.python, str(env_dir)]),
            (
                f"installing {len(requirements)} requirements",
                [uv, "pip", "install", "--quiet", "--python", str(env_dir / "bin" / "python"), *requirements],
            ),
        )
        for done, (what, cmd) in enumerate(steps):
            log(progress.line(done, len(steps), f"job environment {spec.tag}: {what}"))
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                shutil.rmtree(env_dir, ignore_errors=True)
                raise EnvironmentBuildError(
                    f"building environment {spec.tag} failed at `{shlex.join(cmd[1:4])} ...`:\n{proc.stderr[-3000:]}"
                )
        self.builds += 1
        (env_dir / ".kinetic-complete").write_text("\n".join(spec.requirements) + "\n")
        log(progress.line(len(steps), len(steps), f"job environment {spec.tag}: ready"))

    @staticmethod
    def _sync_runner(python: Path) -> None:
        stamp = runner_digest()
        lib = next((python.parent.parent / "lib").glob("python3*/site-packages"))
        target = lib / "kinetic_prefect"
        if (target / ".stamp").exists() and (target / ".stamp").read_text() == stamp:
            return
        target.mkdir(exist_ok=True)
        sources = runner_sources()
        for name, blob in sources.items():
            (lib / name).parent.mkdir(parents=True, exist_ok=True)
            (lib / name).write_bytes(blob)
        for stale in target.rglob("*.py"):  # an environment made by an older layout of the runner
            if stale.relative_to(lib).as_posix() not in sources:
                stale.unlink()
        (target / ".stamp").write_text(stamp)


# What a local job takes from the machine's environment: what an image would give a pod (paths,
# locale, temp dirs, proxies and CA bundles, device and thread settings, the cloud credentials the
# store's client reads), never the caller's other variables. A job sees these, the pool's ``env``
# and what ``env=`` forwards: the same set on every pool and both submission paths.
MACHINE_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TZ",
    "TMPDIR",
    "TEMP",
    "TMP",
    "TERM",
    "XDG_*",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "*_PROXY",
    "*_proxy",
    "SSL_CERT_*",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_*",
    "TPU_*",
    "OPENBLAS_*",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_CLOUD_PROJECT",
    "CLOUDSDK_*",
    "STORAGE_EMULATOR_HOST",
    "GCSFS_*",
    Env.CACHE_DIR,
    Env.NODE_CACHE,
    Env.CHECKPOINT_SYNC_SECONDS,
    Env.LOCAL_DEVICES,
)


def machine_environment(extra_patterns: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    import fnmatch

    patterns = (*MACHINE_ENV, *extra_patterns)
    return {k: v for k, v in os.environ.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
