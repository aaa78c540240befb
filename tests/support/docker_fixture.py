"""pytest plugin: a Docker engine, a local registry and a locally made Python base image, for container tests.

Docker Hub is unreachable where these tests run, so nothing is pulled: the base image is a Debian rootfs made by
``debootstrap`` and ``docker import``-ed, and images are pushed to a ``docker-registry`` on 127.0.0.1.

Each fixture first uses what is already there (``DOCKER_HOST`` or ``/var/run/docker.sock``; a registry on
127.0.0.1:5000; the base image in the engine), which is what ``.ci/setup-containers.sh`` provides, and otherwise
starts its own from the installed binaries. When something cannot be had the tests skip with the reason on a
workstation, and fail under CI (``CI`` set): in CI a skipped container test would hide a broken setup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

SETUP_HINT = '`eval "$(.ci/setup-containers.sh)"` installs and starts them (Debian/Ubuntu, as root)'
BASE_IMAGE_REPOSITORY = "kinetic-test/python"
# Debian releases whose python3 is the minor version of the interpreter running the tests: the image must
# unpickle what this interpreter pickles.
DEBIAN_SUITE_FOR_PYTHON = {"3.11": "bookworm", "3.13": "trixie"}
BASE_PACKAGES = ("python3", "python3-pip", "python3-venv", "ca-certificates")
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")


def unavailable(reason: str):
    """Skip on a workstation; fail under CI, where container tests must run."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so container tests may not skip; {SETUP_HINT})", pytrace=False)
    pytest.skip(f"{reason}; {SETUP_HINT}")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(_SBIN))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclasses.dataclass(frozen=True)
class DockerEngine:
    host: str  # the DOCKER_HOST value; also exported to os.environ for the whole session
    cli: str

    def run(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [self.cli, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "DOCKER_HOST": self.host},
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"`docker {' '.join(args)}` failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc


def _answers(cli: str, host: str) -> tuple[bool, str]:
    try:
        proc = subprocess.run(
            [cli, "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            text=True,
            timeout=20,
            env={**os.environ, "DOCKER_HOST": host},
        )
    except subprocess.TimeoutExpired:
        return False, "`docker version` timed out"
    return proc.returncode == 0, (proc.stderr or proc.stdout).strip()


# The same fallbacks as .ci/setup-containers.sh: overlay2 first (fast), vfs where overlay mounts are refused;
# without iptables/bridge where the sandbox forbids network setup (builds use --network host, runs --network none).
DOCKERD_ATTEMPTS = (
    ["--storage-driver", "overlay2"],
    ["--storage-driver", "overlay2", "--iptables=false", "--bridge=none"],
    ["--storage-driver", "vfs"],
    ["--storage-driver", "vfs", "--iptables=false", "--bridge=none"],
)


def _start_dockerd(dockerd: str, cli: str, root: Path) -> tuple[subprocess.Popen, str]:
    failures = []
    for number, flags in enumerate(DOCKERD_ATTEMPTS):
        attempt = root / str(number)  # a fresh data-root: a failed driver leaves state another one rejects
        attempt.mkdir()
        host = f"unix://{attempt}/docker.sock"
        log_path = attempt / "dockerd.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    dockerd,
                    "--data-root",
                    str(attempt / "data"),
                    "--exec-root",
                    str(attempt / "exec"),
                    "--pidfile",
                    str(attempt / "dockerd.pid"),
                    "-H",
                    host,
                    *flags,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if _answers(cli, host)[0]:
                return proc, host
            time.sleep(0.5)
        _stop(proc)
        failures.append(f"dockerd {' '.join(flags)}: " + log_path.read_text(errors="replace")[-1500:])
    unavailable("could not start dockerd:\n" + "\n".join(failures))
    raise AssertionError("unreachable")


def _unmount_under(root: Path) -> None:
    """dockerd leaves its exec-root's netns bind mount behind when it stops; without this rm -rf fails there."""
    with open("/proc/mounts") as mounts:
        points = [line.split()[1] for line in mounts if line.split()[1].startswith(f"{root}/")]
    for point in sorted(points, reverse=True):
        subprocess.run(["umount", point], capture_output=True)


@pytest.fixture(scope="session")
def docker_engine():
    """A Docker engine and CLI; ``DOCKER_HOST`` points at it for the session."""
    cli = _which("docker")
    if cli is None:
        unavailable("no `docker` CLI on PATH")
    saved = os.environ.get("DOCKER_HOST")
    proc = root = None
    if saved:
        ok, error = _answers(cli, saved)
        if not ok:
            unavailable(f"DOCKER_HOST={saved} does not answer: {error}")
        host = saved
    elif os.path.exists("/var/run/docker.sock") and _answers(cli, "unix:///var/run/docker.sock")[0]:
        host = "unix:///var/run/docker.sock"
    else:
        dockerd = _which("dockerd")
        if dockerd is None:
            unavailable("no Docker engine answers and there is no `dockerd` to start one")
        if os.geteuid() != 0:
            unavailable("no Docker engine answers and starting dockerd needs root")
        # A short path under /tmp: the socket path must stay under the 108-byte limit for unix sockets.
        root = Path(tempfile.mkdtemp(prefix="kp-dockerd-"))
        proc, host = _start_dockerd(dockerd, cli, root)
    os.environ["DOCKER_HOST"] = host
    try:
        yield DockerEngine(host=host, cli=cli)
    finally:
        if saved is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved
        if proc is not None:
            _stop(proc)
            _unmount_under(root)
            # Deleting the image layers takes ~15 s; nothing waits for it, so it happens after the session.
            subprocess.Popen(
                ["rm", "-rf", str(root)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )


def _registry_answers(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/v2/", timeout=3) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="session")
def local_registry():
    """``host:port`` of a plain-HTTP registry on 127.0.0.1 (Docker trusts 127.0.0.0/8 without TLS)."""
    explicit = os.environ.get("KINETIC_TEST_REGISTRY")
    if explicit:
        if not _registry_answers(explicit):
            unavailable(f"KINETIC_TEST_REGISTRY={explicit} does not answer on /v2/")
        yield explicit
        return
    if _registry_answers("127.0.0.1:5000"):
        yield "127.0.0.1:5000"
        return
    binary = _which("docker-registry") or _which("registry")
    if binary is None:
        unavailable("no registry answers on 127.0.0.1:5000 and `docker-registry` is not installed")
    root = Path(tempfile.mkdtemp(prefix="kp-registry-"))
    address = f"127.0.0.1:{_free_port()}"
    config = root / "config.yml"
    # Debian's packaged config turns on htpasswd auth; this one has none, and keeps its blobs in a temp dir.
    config.write_text(
        f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root}/data\n"
        f"  delete:\n    enabled: true\nhttp:\n  addr: {address}\n"
    )
    with open(root / "registry.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, "serve", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while not _registry_answers(address):
            if proc.poll() is not None or time.monotonic() > deadline:
                unavailable(f"{binary} did not start:\n{(root / 'registry.log').read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        yield address
    finally:
        _stop(proc)
        shutil.rmtree(root, ignore_errors=True)


def _cache_dir() -> Path:
    explicit = os.environ.get("KINETIC_DEBOOTSTRAP_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "kinetic-prefect" / "debootstrap"


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # two sessions must not debootstrap into the same cache at once
        yield


def _rootfs_tarball(suite: str) -> Path:
    """A cached tarball of ``debootstrap --variant=minbase`` with Python (≈45 s to make, once per machine)."""
    cache = _cache_dir()
    key = hashlib.sha256(" ".join(BASE_PACKAGES).encode()).hexdigest()[:8]
    tarball = cache / f"{suite}-minbase-{key}.tar"
    with _locked(cache / ".lock"):
        if tarball.is_file():
            return tarball
        debootstrap = _which("debootstrap")
        if debootstrap is None:
            unavailable("the base image is missing and `debootstrap` is not installed to make it")
        if os.geteuid() != 0:
            unavailable("the base image is missing and debootstrap needs root")
        rootfs = Path(tempfile.mkdtemp(prefix=f"{suite}-", dir=cache))
        try:
            mirror = os.environ.get("KINETIC_DEBIAN_MIRROR", "http://deb.debian.org/debian")
            proc = subprocess.run(
                [debootstrap, "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", suite, str(rootfs), mirror],
                capture_output=True,
                text=True,
                timeout=900,
            )
            if proc.returncode != 0:
                unavailable(f"debootstrap {suite} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
            partial = tarball.with_suffix(".tar.partial")
            # Without the downloaded .debs and package lists: ~100 MB less to import.
            subprocess.run(
                [
                    "tar",
                    "-C",
                    str(rootfs),
                    "--exclude=./var/cache/apt/archives/*.deb",
                    "--exclude=./var/lib/apt/lists/*",
                    "-cf",
                    str(partial),
                    ".",
                ],
                check=True,
            )
            os.replace(partial, tarball)
        finally:
            shutil.rmtree(rootfs, ignore_errors=True)
    return tarball


@pytest.fixture(scope="session")
def python_base_image(docker_engine) -> str:
    """A local Debian image with the test interpreter's Python minor version, pip, venv and CA certificates."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    suite = DEBIAN_SUITE_FOR_PYTHON.get(python)
    if suite is None:
        unavailable(f"no Debian release ships Python {python} as python3 (known: {DEBIAN_SUITE_FOR_PYTHON})")
    name = f"{BASE_IMAGE_REPOSITORY}:{python}-{suite}"
    if docker_engine.run("image", "inspect", name, check=False).returncode == 0:
        return name
    tarball = _rootfs_tarball(suite)
    docker_engine.run(
        "import",
        "--change",
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--change",
        "ENV LANG=C.UTF-8",
        "--change",
        'CMD ["python3"]',
        str(tarball),
        name,
    )
    return name


def proxy_files() -> dict[str, bytes]:
    """The host's CA bundle and a pip.conf that trusts it, for builds behind a TLS-intercepting proxy
    (this machine reaches PyPI through one; a corporate workstation may too)."""
    import ssl

    bundle = Path(ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt")
    return {
        "etc/ssl/certs/ca-certificates.crt": bundle.read_bytes(),
        "etc/pip.conf": b"[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n",
    }
