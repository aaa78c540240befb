"""The accelerator catalog: canonical entries are self-consistent, user spellings resolve, bad names fail helpfully."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from kinetic_prefect import accelerators as acc
from kinetic_prefect.accelerators import AcceleratorSpec, UnknownAcceleratorError, resolve

pytestmark = pytest.mark.no_server

CATALOG = acc.catalog()


def test_catalog_is_stable_and_unique():
    assert [s.name for s in CATALOG] == acc.names() == [s.name for s in acc.catalog()]
    assert len(set(acc.names())) == len(CATALOG)
    assert CATALOG[0].name == "cpu"
    assert not any(s.spot for s in CATALOG)


@pytest.mark.parametrize("spec", CATALOG, ids=lambda s: s.name)
def test_entry_resolves_to_itself(spec: AcceleratorSpec):
    assert resolve(spec.name) == spec
    assert resolve(spec.name.upper()) == spec
    assert resolve(spec) is spec


@pytest.mark.parametrize("spec", CATALOG, ids=lambda s: s.name)
def test_entry_is_self_consistent(spec: AcceleratorSpec):
    assert spec.chips == spec.chips_per_host * spec.hosts
    assert spec.resource_count == spec.chips_per_host
    assert spec.multi_host == (spec.hosts > 1)
    assert spec.machine_type
    if spec.family == "cpu":
        assert (spec.chips, spec.resource_name, spec.gke_accelerator, spec.tpu_topology) == (0, None, None, None)
        assert spec.node_label_key is None and spec.node_selector == {}
        assert spec.jax_platform == "cpu"
    elif spec.family == "gpu":
        assert spec.resource_name == "nvidia.com/gpu"
        assert spec.hosts == 1 and spec.tpu_topology is None
        assert spec.gke_accelerator and spec.gke_accelerator.startswith("nvidia-")
        assert spec.node_selector == {"cloud.google.com/gke-accelerator": spec.gke_accelerator}
        assert spec.jax_platform == "cuda"
    else:
        assert spec.family == "tpu"
        assert spec.resource_name == "google.com/tpu"
        assert spec.tpu_topology is not None
        assert math.prod(int(d) for d in spec.tpu_topology.split("x")) == spec.chips
        assert spec.node_selector == {
            "cloud.google.com/gke-tpu-accelerator": spec.gke_accelerator,
            "cloud.google.com/gke-tpu-topology": spec.tpu_topology,
        }
        # Every multi-host slice is built from 4-chip VMs; the machine type's suffix is chips per VM.
        if spec.multi_host:
            assert spec.chips_per_host == 4
        assert spec.machine_type.endswith(f"-{spec.chips_per_host}t")
        assert spec.jax_platform == "tpu"


def test_v6e_and_v5e_single_host_shapes():
    for prefix in ("tpu-v6e-", "tpu-v5litepod-"):
        single = {s.tpu_topology: s.chips_per_host for s in CATALOG if s.name.startswith(prefix) and not s.multi_host}
        assert single == {"1x1": 1, "2x2": 4, "2x4": 8}
        multi = [s.tpu_topology for s in CATALOG if s.name.startswith(prefix) and s.multi_host]
        # v6e's 2x4 also comes as two ct6e-standard-4t hosts (tpu-v6e-8-2hosts): Keras Kinetic's v6e-8
        assert multi == ["4x4", "4x8", "8x8", "8x16", "16x16", *(["2x4"] if prefix == "tpu-v6e-" else [])]


def test_tensorcore_naming_for_v4_v5p_tpu7x():
    # v4 / v5p / TPU7x names count TensorCores (2 per chip); v5e / v6e names count chips.
    assert resolve("tpu-v4-8").chips == 4 and resolve("tpu-v4-8").tpu_topology == "2x2x1"
    assert resolve("tpu-v5p-8").chips == 4 and not resolve("tpu-v5p-8").multi_host
    assert resolve("tpu-v5p-16").tpu_topology == "2x2x2" and resolve("tpu-v5p-16").hosts == 2
    assert resolve("tpu7x-8").chips == 4
    assert resolve("tpu-v6e-8").chips == 8
    assert resolve("tpu-v5litepod-8").chips == 8


@pytest.mark.parametrize(
    "spelling, expected",
    [
        ("cpu", "cpu"),
        ("CPU", "cpu"),
        ("l4", "l4"),
        ("L4", "l4"),
        ("nvidia-l4", "l4"),
        ("  l4  ", "l4"),
        ("a100", "a100"),
        ("nvidia-tesla-a100", "a100"),
        ("h100", "h100"),
        ("nvidia-h100-80gb", "h100"),
        ("gpu", "l4"),
        ("gpu:2", "l4x2"),
        ("l4x2", "l4x2"),
        ("l4:2", "l4x2"),
        ("t4x4", "t4x4"),
        ("nvidia-tesla-t4", "t4"),
        ("h100x8", "h100x8"),
        ("a100-80gb", "a100-80gb"),
        ("nvidia-a100-80gb:4", "a100-80gbx4"),
        ("a100x16", "a100x16"),
        ("h200", "h200x8"),
        ("nvidia-b200", "b200x8"),
        ("v5e", "tpu-v5litepod-1"),
        ("v6e", "tpu-v6e-1"),
        ("tpu-v6e-8", "tpu-v6e-8"),
        ("tpu-v5litepod-1", "tpu-v5litepod-1"),
        ("tpu-v5litepod-8", "tpu-v5litepod-8"),
        ("v5litepod-4", "tpu-v5litepod-4"),
        ("tpu-v5e-4", "tpu-v5litepod-4"),
        ("v6e-16", "tpu-v6e-16"),
        ("v6e-2x4", "tpu-v6e-8"),
        ("tpu-v6e-slice", "tpu-v6e-1"),
        ("tpu-v4-8", "tpu-v4-8"),
        ("v4-16", "tpu-v4-16"),
        ("v5p", "tpu-v5p-8"),
        ("tpu7x", "tpu7x-8"),
        ("tpu7x-2x2x2", "tpu7x-16"),
    ],
)
def test_user_spellings(spelling: str, expected: str):
    spec = resolve(spelling)
    assert spec.name == expected
    assert not spec.spot


def test_multi_host_slice_shape():
    spec = resolve("v6e-16")
    assert (spec.chips, spec.hosts, spec.chips_per_host, spec.resource_count) == (16, 4, 4, 4)
    assert spec.machine_type == "ct6e-standard-4t" and spec.tpu_topology == "4x4"


@pytest.mark.parametrize(
    "spelling, expected",
    [
        ("l4:spot", "l4"),
        ("tpu-v6e-8:spot", "tpu-v6e-8"),
        ("h100x8:spot", "h100x8"),
        ("GPU:2:SPOT", "l4x2"),
        ("cpu : spot", "cpu"),
    ],
)
def test_spot_suffix(spelling: str, expected: str):
    spec = resolve(spelling)
    assert spec.name == expected and spec.spot
    assert spec.node_selector["cloud.google.com/gke-spot"] == "true"
    assert spec.with_spot(False) == acc.resolve(expected)
    assert resolve(spec) is spec


@pytest.mark.parametrize(
    "bad, suggestion",
    [
        ("tpu-v6e-3", "tpu-v6e-4"),
        ("l7", "l4"),
        ("l4x3", "l4x2"),
        ("h100x3", "h100x4"),
        ("gpu:0", "l4"),
        ("", "cpu"),
        ("tpu-v5litepod-5", "tpu-v5litepod-4"),
        ("tpu-v4-4", "tpu-v4-8"),
        ("h100x8:spott", "h100x8"),
    ],
)
def test_bad_names_suggest(bad: str, suggestion: str):
    with pytest.raises(UnknownAcceleratorError) as info:
        resolve(bad)
    message = str(info.value)
    assert "Closest valid names:" in message and suggestion in message
    assert "python -m kinetic_prefect.accelerators" in message
    assert isinstance(info.value, ValueError)


def test_non_string_is_a_type_error():
    with pytest.raises(TypeError):
        resolve(8)  # type: ignore[arg-type]


def test_markdown_table_lists_everything():
    table = acc.markdown_table()
    for name in acc.names():
        assert f"`{name}`" in table
    assert table.count("\n") == len(CATALOG) + 2


def test_module_is_a_light_leaf():
    code = "import kinetic_prefect.accelerators, sys; assert 'prefect' not in sys.modules, 'prefect imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    # The module itself imports only the stdlib, whatever the package __init__ does.
    source = Path(acc.__file__).read_text()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"__future__", "dataclasses", "difflib", "re"}


def test_main_prints_table():
    out = subprocess.run(
        [sys.executable, "-m", "kinetic_prefect.accelerators"], check=True, capture_output=True, text=True
    ).stdout
    assert out == acc.markdown_table()
