"""Caller side: the environment a job runs in, named by a hash of what goes into it.

An :class:`ImageSpec` is everything that decides a job's software environment. Its
:attr:`ImageSpec.tag` is a pure function of those inputs, so the same inputs always map to
the same local uv environment (``kinetic-local``) or container image (``kinetic-gke``) and
nothing is built twice.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from kinetic_prefect.version import __version__


class RequirementsError(ValueError):
    """A requirements input that cannot be used; the message names the file/line and the fix."""


# The user a built job image runs as, and the one kinetic-gke's pods run as (``runAsUser``): never root. Part of
# the environment's hash, so an image built before it ran as this user is never reused.
JOB_USER_ID = 10001


def _normalize_one(line: str, origin: str) -> str:
    try:
        req = Requirement(line)
    except InvalidRequirement as exc:
        raise RequirementsError(
            f"{origin}: {line!r} is not a valid requirement ({exc}). "
            "Use PEP 508 form, e.g. 'keras>=3.8' or 'jax[cpu]==0.4.35'."
        ) from None
    # Canonical spelling, so 'Keras >= 3.8' and 'keras>=3.8' give the same tag.
    req.name = canonicalize_name(req.name)
    req.extras = {canonicalize_name(e) for e in req.extras}
    return str(req)


# pip's spellings of "read this other file too": ``-r X``, ``-rX``, ``--requirement X``, ``--requirement=X``.
_INCLUDE_OPTIONS = ("--requirement", "-r")
_CONSTRAINT_OPTIONS = ("--constraint", "-c")


def _option_target(text: str, options: tuple[str, ...]) -> str | None:
    """The file a ``-r``/``-c`` line names ('' when it names none), or None when the line is not that option."""
    for option in options:
        if text == option:
            return ""
        rest = text[len(option) :]
        if not text.startswith(option) or not rest:
            continue
        if rest[0] in " \t=":
            return rest.lstrip(" \t=").strip()
        if not option.startswith("--"):  # -rbase.txt; --requirements is not --requirement
            return rest.strip()
    return None


def _read_requirements_file(path: Path, including: tuple[Path, ...] = ()) -> list[tuple[str, str]]:
    """The requirement lines of ``path`` and of the files it includes (relative to it, as pip reads them), each with
    its ``file:line``. ``including``: the files whose includes led here, to refuse a cycle by name."""
    chain = (*including, path.resolve())
    lines: list[tuple[str, str]] = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        text = raw.split(" #", 1)[0].strip()
        if not text or text.startswith("#"):
            continue
        where = f"{path}:{number}"
        constraint = _option_target(text, _CONSTRAINT_OPTIONS)
        if constraint is not None:
            # The job's environment is built from requirements alone: a constraints file read as requirements would
            # install every package it pins, and one applied to the listed packages only would miss the transitive
            # ones it is usually there for.
            raise RequirementsError(
                f"{where}: {text!r}: constraints files are not supported in kinetic requirements (the job's "
                f"environment is built from the requirements alone, and {constraint or 'its entries'} would be "
                "installed as packages). Pin the versions you need in the requirements themselves, e.g. "
                "'urllib3<2' as its own line: a listed pin holds a transitive package too."
            )
        target = _option_target(text, _INCLUDE_OPTIONS)
        if target is not None:
            lines.extend(_read_included(where, text, target, path, chain))
            continue
        if text.startswith("-"):
            raise RequirementsError(
                f"{where}: pip option {text!r} is not supported in kinetic requirements; "
                "list packages only (indexes are configured on the worker)."
            )
        lines.append((text, where))
    return lines


def _read_included(where: str, text: str, target: str, path: Path, chain: tuple[Path, ...]) -> list[tuple[str, str]]:
    if not target:
        raise RequirementsError(f"{where}: {text!r} names no file; write e.g. '-r base.txt'.")
    included = (path.parent / target).expanduser().resolve()
    if included in chain:
        cycle = " -> ".join(str(p) for p in (*chain[chain.index(included) :], included))
        raise RequirementsError(
            f"{where}: requirements file {included} includes itself ({cycle}); drop the '-r' line that closes "
            "the cycle."
        )
    if not included.is_file():
        raise RequirementsError(f"{where}: {text!r}: requirements file {str(included)!r} does not exist.")
    return _read_requirements_file(included, chain)


def _read_pyproject(path: Path) -> list[tuple[str, str]]:
    data = tomllib.loads(path.read_text())
    deps = data.get("project", {}).get("dependencies")
    if deps is None:
        raise RequirementsError(
            f"{path}: no [project].dependencies table; list the job's packages there "
            "or pass requirements=[...] / a requirements.txt instead."
        )
    return [(d, f"{path}:[project].dependencies") for d in deps]


def check_requirements(requirements: Sequence[str], origin: str = "requirements") -> tuple[str, ...]:
    """The requirements a worker is asked to build from (a job variable), held to the caller's rule: each entry one
    PEP 508 requirement on one line, no pip option (``--index-url``, ``-e``), no bare URL or path. Returns them
    normalized; raises :class:`RequirementsError` naming the entry."""
    if isinstance(requirements, (str, bytes)) or not isinstance(requirements, Sequence):
        raise RequirementsError(f"{origin} must be a list of PEP 508 requirements, not {type(requirements).__name__}")
    checked = []
    for i, line in enumerate(requirements):
        where = f"{origin}[{i}]"
        if (
            not isinstance(line, str)
            or not line.strip()
            or "\n" in line
            or "\r" in line
            or line.lstrip().startswith("-")
        ):
            raise RequirementsError(
                f"{where}: {line!r} is not one PEP 508 requirement (a pip option, an empty or multi-line entry); "
                "list packages only, e.g. 'keras>=3.8'"
            )
        checked.append(_normalize_one(line, where))
    return tuple(checked)


def normalize_requirements(requirements: str | Path | Sequence[str] | None) -> tuple[str, ...]:
    """Requirements from a file (requirements.txt or pyproject.toml) or a list, canonical and sorted."""
    if requirements is None:
        return ()
    if isinstance(requirements, (str, Path)) and (
        isinstance(requirements, Path) or requirements.endswith((".txt", ".toml", ".in"))
    ):
        path = Path(requirements).expanduser()
        if not path.is_file():
            raise RequirementsError(
                f"requirements file {str(path)!r} does not exist; pass an existing "
                "requirements.txt / pyproject.toml path or a list of packages."
            )
        entries = _read_pyproject(path) if path.name.endswith(".toml") else _read_requirements_file(path)
    elif isinstance(requirements, str):
        raise RequirementsError(
            f"requirements={requirements!r} is neither a .txt/.toml file path nor a list; "
            f"write requirements=[{requirements!r}] for a single package."
        )
    else:
        entries = [(str(r), f"requirements[{i}]") for i, r in enumerate(requirements)]
    return tuple(sorted({_normalize_one(text, origin) for text, origin in entries}))


# What `python -m kinetic_prefect.pod.runner` imports from this package; environments and images get
# copies of exactly these files (kinetic-prefect itself, and Prefect, stay out of job environments).
RUNNER_MODULES = (
    "__init__",
    "contract/__init__",
    # the contract's seams, each re-exported by its __init__
    "contract/names",
    "contract/env",
    "contract/layout",
    "contract/handovers",
    "contract/group",
    "contract/phases",
    "contract/records",
    "contract/settings",  # the settings table: the job reads its own settings through it
    "storage",
    "signing",
    "errors",
    "accelerators",
    "config",
    "version",
    "pod/__init__",
    "pod/runner",
    "pod/warm_runner",
    "pod/slot_runner",
    "pod/working_copy",
    "pod/outputs",
    "pod/progress",
    "pod/data",
    "pod/data_sources",
    "pod/data_manifest",
    "pod/data_upload",
    "pod/data_ref",
    "pod/data_localize",
    "pod/data_hf",
    "pod/data_walk",
    "pod/utilization",
    "pod/debugger",
    # the short public paths: ``python -m kinetic_prefect.runner`` (the command of pool templates and images made
    # before the pod/ layout) and the job-side imports the docs show (``kinetic_prefect.progress``, ``.outputs``)
    "runner",
    "outputs",
    "progress",
)


def runner_sources() -> dict[str, bytes]:
    """``{"kinetic_prefect/<path>.py": source}`` for the job runner."""
    package_dir = Path(__file__).resolve().parent.parent
    sources = {}
    for module in RUNNER_MODULES:
        path = package_dir / f"{module}.py"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the job runner needs kinetic_prefect/{module}.py")
        sources[f"kinetic_prefect/{module}.py"] = path.read_bytes()
    return sources


def runner_digest() -> str:
    digest = hashlib.sha256()
    for name, source in sorted(runner_sources().items()):
        digest.update(name.encode() + b"\0" + source)
    return digest.hexdigest()[:16]


def _cloudpickle_version() -> str:
    import cloudpickle

    return str(cloudpickle.__version__)


@dataclass(frozen=True)
class ImageSpec:
    """Inputs that define a job environment; equal specs share one environment/image."""

    requirements: tuple[str, ...] = ()
    python: str = field(default_factory=lambda: f"{sys.version_info.major}.{sys.version_info.minor}")
    family: str = "cpu"
    base_image: str | None = None
    kinetic_version: str = __version__

    @classmethod
    def create(
        cls,
        requirements: str | Path | Iterable[str] | None = None,
        family: str = "cpu",
        base_image: str | None = None,
        python: str | None = None,
    ) -> ImageSpec:
        reqs = normalize_requirements(
            requirements if requirements is None or isinstance(requirements, (str, Path)) else list(requirements)
        )
        kwargs = {"python": python} if python else {}
        return cls(requirements=reqs, family=family, base_image=base_image, **kwargs)

    @property
    def uses_caller_interpreter(self) -> bool:
        """No requirements and no base image: the job can run on the caller's own interpreter."""
        return not self.requirements and self.base_image is None

    def fingerprint(self) -> str:
        canonical = json.dumps(
            {
                "requirements": list(self.requirements),
                "python": self.python,
                "family": self.family,
                "base_image": self.base_image,
                "kinetic_version": self.kinetic_version,
                # Pickles written by one cloudpickle version are only promised to load with the same one.
                "cloudpickle": _cloudpickle_version(),
                # A built image carries a copy of the runner: a changed runner must not reuse an old image.
                "runner": runner_digest(),
                # A built image runs as this user (builders.dockerfile): one built as root is not reused.
                "user": JOB_USER_ID,
            },
            sort_keys=True,
        )
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def tag(self) -> str:
        """Deterministic, registry-safe tag such as ``py311-gpu-3f9c2a1b7d4e5f60``."""
        return f"py{self.python.replace('.', '')}-{self.family}-{self.fingerprint()[:16]}"
