"""Benchmark (not collected by default: the name has no ``test_`` prefix): the job image a kinetic-gke pool builds for
a EuroSAT-like set of requirements — its size and layers, a cold build, a build after one small requirement changed,
and pulls from the local registry — written to ``bench/results/job_image.json``.

    eval "$(bash .ci/setup-containers.sh)"
    CI=1 uv run --all-extras pytest -q -s tests/shared/bench_job_image.py

The EuroSAT pipeline's job imports Keras (on JAX), NumPy and reads PNGs; on a GPU pool its image also carries
``jax[cuda12]`` (CUDA as pip wheels, gigabytes). Here the CPU family is built (``keras>=3.8``, ``jax``, ``pillow``:
the same layers without the CUDA wheels), from the tests' Python base image labelled afresh (nothing cached), with
pip going through this machine's proxy. The local registry is on 127.0.0.1: its pull times are the unpacking, not a
network's transfer.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from datetime import datetime
from pathlib import Path

from docker_fixture import proxy_files

from kinetic_prefect.shared.builders import DockerBuilder
from kinetic_prefect.shared.image import ImageSpec

# KINETIC_BENCH_OUT: another file (the same bench against another checkout's builders, for a comparison)
RESULTS = Path(
    os.environ.get("KINETIC_BENCH_OUT") or Path(__file__).resolve().parents[2] / "bench/results/job_image.json"
)
REQUIREMENTS = ["keras>=3.8", "jax", "pillow"]


def _docker(*args: str) -> str:
    return subprocess.run(["docker", *args], check=True, capture_output=True, text=True).stdout.strip()


def _layers(image: str) -> list[dict]:
    """The image's layers, newest first, with the step that made each (``docker history``)."""
    rows = _docker("history", "--no-trunc", "--format", "{{.Size}}\t{{.CreatedBy}}", image).splitlines()
    layers = []
    for row in rows:
        size, _, step = row.partition("\t")
        if size not in ("0B", "0"):
            layers.append({"size": size, "step": step.replace("/bin/sh -c ", "")[:110]})
    return layers


def _pull_seconds(image: str) -> float:
    subprocess.run(["docker", "rmi", image], capture_output=True)
    started = time.monotonic()
    _docker("pull", "-q", image)
    return round(time.monotonic() - started, 1)


def test_the_eurosat_like_job_image(local_registry, python_base_image):
    base = f"kinetic-test/python:image-bench-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["docker", "build", "-q", "--label", f"kinetic.bench={base}", "-t", base, "-"],
        input=f"FROM {python_base_image}\n",
        text=True,
        check=True,
        capture_output=True,
    )
    builder = DockerBuilder(f"{local_registry}/kinetic-bench", network="host", extra_files=proxy_files())
    spec = ImageSpec.create(REQUIREMENTS, family="cpu", base_image=base)
    started = time.monotonic()
    image = builder.ensure(spec, log=lambda line: None)
    cold = time.monotonic() - started
    changed_spec = ImageSpec.create([*REQUIREMENTS, "tabulate"], family="cpu", base_image=base)
    started = time.monotonic()
    changed = builder.ensure(changed_spec, log=lambda line: None)
    cached = time.monotonic() - started
    base_size = int(_docker("image", "inspect", "-f", "{{.Size}}", base))
    size = int(_docker("image", "inspect", "-f", "{{.Size}}", image))
    layers = len(json.loads(_docker("image", "inspect", "-f", "{{json .RootFS.Layers}}", image)))
    subprocess.run(["docker", "rmi", image], capture_output=True)
    full_pull = _pull_seconds(changed)  # the base's layers stay: a node has them after any earlier job of the pool
    subprocess.run(["docker", "rmi", changed], capture_output=True)
    _docker("pull", "-q", image)  # the node has the earlier image: the frameworks' layer is the same layer
    changed_pull = _pull_seconds(changed)
    shared = set(json.loads(_docker("image", "inspect", "-f", "{{json .RootFS.Layers}}", image)))
    new_layers = [x for x in json.loads(_docker("image", "inspect", "-f", "{{json .RootFS.Layers}}", changed))]
    new_layers = [x for x in new_layers if x not in shared]
    result = {
        "what": "the job image kinetic-gke builds for a EuroSAT-like job (CPU family: keras>=3.8, jax, pillow; "
        "a GPU pool adds jax[cuda12]'s CUDA wheels, not built here), from the tests' Python base image",
        "when": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "requirements": REQUIREMENTS,
        "image_mb": round(size / 1e6),
        "base_image_mb": round(base_size / 1e6),
        "added_by_the_job_image_mb": round((size - base_size) / 1e6),
        "layers": layers,
        "layers_of_the_job_image": _layers(image)[:6],
        "build_cold_seconds": round(cold, 1),
        "build_after_one_small_requirement_changed_seconds": round(cached, 1),
        "pull_from_the_local_registry_seconds": {
            "base_present": full_pull,
            "earlier_image_present_one_requirement_changed": changed_pull,
        },
        "layers_pulled_after_one_requirement_changed": len(new_layers),
        "command": "CI=1 uv run --all-extras pytest -q -s tests/shared/bench_job_image.py",
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    for name in (image, changed, base):
        subprocess.run(["docker", "rmi", name], capture_output=True)
