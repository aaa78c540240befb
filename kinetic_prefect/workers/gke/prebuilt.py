"""Kinetic's prebuilt mode on kinetic-gke (pool variable ``install_requirements_at_start``): the image holds the runner
alone, built once per Python version and base image, and each pod installs the call's requirements as it starts.

No image build when requirements change, at the price of an install in every pod (and the node's pip reaching the
index); for requirements that change from call to call. The bundled image (the default) installs them once, at build
time, and a pod starts at once on a node that has the image.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kinetic_prefect.contract import RUNNER_ARGV, Env


def runner_only(spec: Any) -> Any:
    """The image spec of the prebuilt image: the call's, without its requirements."""
    return dataclasses.replace(spec, requirements=())


def install_env(spec: Any) -> dict[str, str]:
    """The container's variable holding what the pod installs: the lines a bundled image's requirements.txt would
    hold (the accelerator's JAX build and the runner's own pins included), as a JSON list."""
    from kinetic_prefect.shared.builders import requirements_lines

    return {"name": Env.INSTALL_REQUIREMENTS, "value": json.dumps(requirements_lines(spec))}


# pip into the job user's home (the image's venv is root's), then the runner with that folder first on its path
_BOOTSTRAP = f"""
import json, os, subprocess, sys
site = os.path.join(os.path.expanduser("~"), ".kinetic-site")
lines = json.loads(os.environ.get("{Env.INSTALL_REQUIREMENTS}") or "[]")
args = [part for line in lines for part in (line.split(" ", 1) if line.startswith("-") else [line])]
if args:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "--target", site, *args])
    os.environ["PYTHONPATH"] = site + os.pathsep + os.environ.get("PYTHONPATH", "")
argv = {json.dumps(list(RUNNER_ARGV))}
os.execvp(argv[0], argv)
"""


def install_then_run() -> list[str]:
    """The container's command in prebuilt mode."""
    return ["python", "-c", _BOOTSTRAP]
