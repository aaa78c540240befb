"""Accelerator catalog: turn what a user types ("l4x2", "v6e-16", "h100x8:spot")
into everything the GKE worker and the job runner need (node labels, resource
counts, machine type, host count, JAX platform).

Leaf module on purpose: stdlib only, no prefect, so the runner and the worker
can import it cheaply.  `python -m kinetic_prefect.accelerators` prints the
catalog as a Markdown table.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass

GPU_LABEL = "cloud.google.com/gke-accelerator"
TPU_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
SPOT_LABEL = "cloud.google.com/gke-spot"
_LIST_HINT = "Run `uv run python -m kinetic_prefect.accelerators` for the full list."


class UnknownAcceleratorError(ValueError):
    """The name is not in the catalog (or asks for a shape GKE cannot build)."""


@dataclass(frozen=True)
class AcceleratorSpec:
    name: str
    family: str  # "cpu" | "gpu" | "tpu"
    chips: int  # whole slice / whole node; 0 for cpu
    gke_accelerator: str | None
    tpu_topology: str | None
    chips_per_host: int  # what one pod requests
    hosts: int  # pods needed: >1 only for multi-host TPU slices
    resource_name: str | None
    machine_type: str
    spot: bool = False

    @property
    def node_label_key(self) -> str | None:
        return {"gpu": GPU_LABEL, "tpu": TPU_LABEL}.get(self.family)

    @property
    def node_selector(self) -> dict[str, str]:
        sel: dict[str, str] = {}
        if self.node_label_key and self.gke_accelerator:
            sel[self.node_label_key] = self.gke_accelerator
        if self.tpu_topology:
            sel[TPU_TOPOLOGY_LABEL] = self.tpu_topology
        if self.spot:
            sel[SPOT_LABEL] = "true"
        return sel

    @property
    def resource_count(self) -> int:
        return self.chips_per_host if self.resource_name else 0

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    @property
    def jax_platform(self) -> str:
        return {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}[self.family]

    def with_spot(self, spot: bool = True) -> AcceleratorSpec:
        return dataclasses.replace(self, spot=spot)


# --------------------------------------------------------------------------
# GPUs.  Label values are GKE's gke-accelerator values (GKE GPU docs; the
# newer ones cross-checked against Google's XPK system_characteristics.py).
# Counts per node and the machine type for each count follow Compute Engine's
# GPU machine-type tables (N1 + attached GPU, G2, A2, A3, A4, A4X, G4): the
# A/G series have the GPUs built in, so the machine type fixes the count.
# N1 counts use a standard shape that stays under each GPU's vCPU cap.
# gb200 (A4X) nodes are arm64; h100-mega/h200/b200 exist only as 8-GPU nodes.
# --------------------------------------------------------------------------
# short name, GKE label value, {gpus per node: machine type}, extra spellings
_GPU_TABLE: list[tuple[str, str, dict[int, str], tuple[str, ...]]] = [
    ("t4", "nvidia-tesla-t4", {1: "n1-standard-8", 2: "n1-standard-16", 4: "n1-standard-32"}, ()),
    ("p4", "nvidia-tesla-p4", {1: "n1-standard-8", 2: "n1-standard-16", 4: "n1-standard-32"}, ()),
    ("p100", "nvidia-tesla-p100", {1: "n1-standard-8", 2: "n1-standard-16", 4: "n1-standard-32"}, ()),
    (
        "v100",
        "nvidia-tesla-v100",
        {1: "n1-standard-8", 2: "n1-standard-16", 4: "n1-standard-32", 8: "n1-standard-64"},
        (),
    ),
    (
        "l4",
        "nvidia-l4",
        {1: "g2-standard-8", 2: "g2-standard-24", 4: "g2-standard-48", 8: "g2-standard-96"},
        ("gpu",),
    ),  # plain "gpu" means the cheap, widely available L4
    (
        "a100",
        "nvidia-tesla-a100",
        {1: "a2-highgpu-1g", 2: "a2-highgpu-2g", 4: "a2-highgpu-4g", 8: "a2-highgpu-8g", 16: "a2-megagpu-16g"},
        ("a100-40gb",),
    ),
    (
        "a100-80gb",
        "nvidia-a100-80gb",
        {1: "a2-ultragpu-1g", 2: "a2-ultragpu-2g", 4: "a2-ultragpu-4g", 8: "a2-ultragpu-8g"},
        (),
    ),
    (
        "h100",
        "nvidia-h100-80gb",
        {1: "a3-highgpu-1g", 2: "a3-highgpu-2g", 4: "a3-highgpu-4g", 8: "a3-highgpu-8g"},
        ("h100-80gb",),
    ),
    ("h100-mega", "nvidia-h100-mega-80gb", {8: "a3-megagpu-8g"}, ("h100-mega-80gb",)),
    ("h200", "nvidia-h200-141gb", {8: "a3-ultragpu-8g"}, ("h200-141gb",)),
    ("b200", "nvidia-b200", {8: "a4-highgpu-8g"}, ()),
    ("gb200", "nvidia-gb200", {4: "a4x-highgpu-4g"}, ()),
    (
        "rtx-pro-6000",
        "nvidia-rtx-pro-6000",
        {1: "g4-standard-48", 2: "g4-standard-96", 4: "g4-standard-192", 8: "g4-standard-384"},
        ("rtx-pro", "rtxpro6000"),
    ),
]

# --------------------------------------------------------------------------
# TPUs.  Label values, topologies and machine types follow GKE's "Plan TPUs
# in GKE" / Ironwood pages and the Cloud TPU v4/v5e/v5p/v6e/TPU7x pages
# (cube shapes for v4/v5p/TPU7x as in XPK's tables).
#
# Naming trap: Cloud TPU names v4, v5p and TPU7x slices by TensorCores (two
# per chip), so tpu-v4-8 / tpu-v5p-8 / tpu7x-8 are 4 chips (2x2x1).  v5e and
# v6e have one TensorCore per chip, so their names count chips: tpu-v6e-8 is
# 8 chips (2x4).  `cores_per_chip` below encodes this.
#
# Single-host shapes may use 1-, 4- or 8-chip VMs; every multi-host slice is
# built from 4-chip VMs (one pod per VM).  TPU7x multi-host node pools are
# created with a workload policy instead of --tpu-topology, but the nodes
# still carry the gke-tpu-topology label we select on.
# --------------------------------------------------------------------------
_CUBE_SHAPES = ["2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"]
_PLANE_SHAPES = ["4x4", "4x8", "8x8", "8x16", "16x16"]


@dataclass(frozen=True)
class _TpuFamily:
    prefix: str  # canonical name prefix
    label: str  # cloud.google.com/gke-tpu-accelerator value
    cores_per_chip: int  # unit of the number in the name (see above)
    single_host: tuple[tuple[str, str], ...]  # (topology, machine type)
    multi_host_machine: str
    multi_host_shapes: tuple[str, ...]
    spellings: tuple[str, ...]
    # Shapes GKE also builds from several 4-chip VMs though a single-host VM exists (named ``<name>-<n>hosts``):
    # Keras Kinetic's v6e-8 is 2x4 on two ct6e-standard-4t hosts, which ported code must keep getting.
    multi_host_too: tuple[str, ...] = ()


_TPU_TABLE = [
    _TpuFamily(
        "tpu-v4",
        "tpu-v4-podslice",
        2,
        (("2x2x1", "ct4p-hightpu-4t"),),
        "ct4p-hightpu-4t",
        tuple(_CUBE_SHAPES),
        ("v4", "tpu-v4-podslice"),
    ),
    _TpuFamily(
        "tpu-v5litepod",
        "tpu-v5-lite-podslice",
        1,
        (("1x1", "ct5lp-hightpu-1t"), ("2x2", "ct5lp-hightpu-4t"), ("2x4", "ct5lp-hightpu-8t")),
        "ct5lp-hightpu-4t",
        tuple(_PLANE_SHAPES),
        ("v5e", "tpu-v5e", "v5litepod", "v5lite", "tpu-v5-lite-podslice"),
    ),
    _TpuFamily(
        "tpu-v5p",
        "tpu-v5p-slice",
        2,
        (("2x2x1", "ct5p-hightpu-4t"),),
        "ct5p-hightpu-4t",
        tuple(_CUBE_SHAPES),
        ("v5p", "tpu-v5p-slice"),
    ),
    _TpuFamily(
        "tpu-v6e",
        "tpu-v6e-slice",
        1,
        (("1x1", "ct6e-standard-1t"), ("2x2", "ct6e-standard-4t"), ("2x4", "ct6e-standard-8t")),
        "ct6e-standard-4t",
        tuple(_PLANE_SHAPES),
        ("v6e", "tpu-v6e-slice", "trillium"),
        ("2x4",),
    ),
    _TpuFamily(
        "tpu7x",
        "tpu7x",
        2,
        (("2x2x1", "tpu7x-standard-4t"),),
        "tpu7x-standard-4t",
        tuple(_CUBE_SHAPES),
        ("v7x", "tpu-v7x", "tpu-7x", "ironwood"),
    ),
]


def _topology_chips(topology: str) -> int:
    product = 1
    for dim in topology.split("x"):
        product *= int(dim)
    return product


def _gpu_family(
    short: str, label: str, machines: dict[int, str], extra: tuple[str, ...]
) -> tuple[list[str], list[AcceleratorSpec]]:
    """(spellings, entries) of one GPU family: an entry per GPU count, named ``<short>`` for one and
    ``<short>x<n>`` for more; spelled by its short name, its node label with and without the vendor prefix."""
    members = [
        AcceleratorSpec(short if n == 1 else f"{short}x{n}", "gpu", n, label, None, n, 1, "nvidia.com/gpu", machine)
        for n, machine in sorted(machines.items())
    ]
    keys = [short, label, label.removeprefix("nvidia-"), *extra]
    if label.startswith("nvidia-tesla-"):
        keys.append(label.removeprefix("nvidia-tesla-"))
    return list(dict.fromkeys(keys)), members


def _tpu_family(fam: _TpuFamily) -> tuple[list[str], list[AcceleratorSpec]]:
    """(spellings, entries) of one TPU family: the single-host shapes, the multi-host ones (4 chips a host),
    then the shapes also built from several hosts though a single-host VM exists."""
    shapes = [(t, m, _topology_chips(t)) for t, m in fam.single_host]
    shapes += [(t, fam.multi_host_machine, 4) for t in fam.multi_host_shapes]
    members = []
    for topology, machine, per_host in shapes:
        chips = _topology_chips(topology)
        members.append(
            AcceleratorSpec(
                f"{fam.prefix}-{chips * fam.cores_per_chip}",
                "tpu",
                chips,
                fam.label,
                topology,
                per_host,
                chips // per_host,
                "google.com/tpu",
                machine,
            )
        )
    for topology in fam.multi_host_too:
        chips = _topology_chips(topology)
        members.append(
            AcceleratorSpec(
                f"{fam.prefix}-{chips * fam.cores_per_chip}-{chips // 4}hosts",
                "tpu",
                chips,
                fam.label,
                topology,
                4,
                chips // 4,
                "google.com/tpu",
                fam.multi_host_machine,
            )
        )
    return [fam.prefix, *fam.spellings], members


def _build() -> tuple[list[AcceleratorSpec], dict[str, list[AcceleratorSpec]], dict[str, str]]:
    """Return (catalog, family key -> its entries, any spelling -> canonical name)."""
    specs = [AcceleratorSpec("cpu", "cpu", 0, None, None, 0, 1, None, "n2-standard-8")]
    families: dict[str, list[AcceleratorSpec]] = {}
    spellings: dict[str, str] = {}
    groups = [_gpu_family(*row) for row in _GPU_TABLE] + [_tpu_family(fam) for fam in _TPU_TABLE]
    for keys, members in groups:
        specs.extend(members)
        for key in keys:
            if key in families or key in spellings:
                raise AssertionError(f"duplicate accelerator spelling {key!r}")
            families[key] = members
            spellings[key] = members[0].name  # a bare family name = smallest entry
    for spec in specs:
        spellings.setdefault(spec.name, spec.name)
    return specs, families, spellings


_CATALOG, _FAMILIES, _SPELLINGS = _build()
_BY_NAME = {spec.name: spec for spec in _CATALOG}

_SPOT_RE = re.compile(r"(.*?)\s*:\s*spot")
_GPU_COUNT_RE = re.compile(r"(.+?)\s*[x:]\s*(\d+)")  # l4x2, l4:2, gpu:2
_TPU_SIZE_RE = re.compile(r"(.+)-(\d+(?:x\d+)*)")  # v6e-16, tpu-v4-8, v6e-2x4


def _unknown(raw: str, key: str, family: list[AcceleratorSpec] | None = None) -> UnknownAcceleratorError:
    if family:  # family is right, size is not: offer every size of that family
        suggestions = [s.name for s in family]
    else:
        close = difflib.get_close_matches(key, list(_SPELLINGS), n=8, cutoff=0.5)
        suggestions = list(dict.fromkeys(_SPELLINGS[c] for c in close))[:5]
    if not suggestions:
        suggestions = ["cpu", "l4", "tpu-v5litepod-1"]
    what = f"Unknown accelerator {raw!r}" if key else "Empty accelerator name"
    msg = f"{what}. Closest valid names: {', '.join(suggestions)}."
    if family and family[0].family == "tpu":
        fam = next(f for f in _TPU_TABLE if f.label == family[0].gke_accelerator)
        if fam.cores_per_chip > 1:
            msg += f" ({fam.prefix} names count TensorCores, {fam.cores_per_chip} per chip: {fam.prefix}-8 is 4 chips.)"
    return UnknownAcceleratorError(f"{msg} {_LIST_HINT}")


def resolve(name: str | AcceleratorSpec) -> AcceleratorSpec:
    """Resolve a user spelling (case/space-insensitive, optional ':spot') to a spec."""
    if isinstance(name, AcceleratorSpec):
        return name
    if not isinstance(name, str):
        raise TypeError(f"accelerator must be a str or AcceleratorSpec, not {type(name).__name__}")
    key = name.strip().lower()
    spot = False
    if m := _SPOT_RE.fullmatch(key):
        key, spot = m.group(1), True
    spec = _lookup(name, key)
    return spec.with_spot(True) if spot else spec


def _lookup(raw: str, key: str) -> AcceleratorSpec:
    if key in _SPELLINGS:
        return _BY_NAME[_SPELLINGS[key]]
    m = _GPU_COUNT_RE.fullmatch(key)
    if m and m.group(1) in _FAMILIES and _FAMILIES[m.group(1)][0].family == "gpu":
        members = _FAMILIES[m.group(1)]
        count = int(m.group(2))
        for spec in members:
            if spec.chips == count:
                return spec
        raise _unknown(raw, key, members)
    m = _TPU_SIZE_RE.fullmatch(key)
    if m and m.group(1) in _FAMILIES and _FAMILIES[m.group(1)][0].family == "tpu":
        members = _FAMILIES[m.group(1)]
        size = m.group(2)
        for spec in members:
            if "x" in size:  # an explicit topology, e.g. v6e-2x4
                if spec.tpu_topology == size:
                    return spec
            elif spec.name.rsplit("-", 1)[1] == str(int(size)):  # cores or chips, per family
                return spec
        raise _unknown(raw, key, members)
    raise _unknown(raw, key)


def catalog() -> list[AcceleratorSpec]:
    """Every canonical entry (non-spot), in a stable order: cpu, GPUs, TPUs."""
    return list(_CATALOG)


def names() -> list[str]:
    return [spec.name for spec in _CATALOG]


def markdown_table() -> str:
    rows = [
        "| Name | Family | Chips | Hosts x chips/host | GKE accelerator | TPU topology | Machine type |",
        "| --- | --- | ---: | --- | --- | --- | --- |",
    ]
    for s in _CATALOG:
        rows.append(
            f"| `{s.name}` | {s.family} | {s.chips} | {s.hosts} x {s.chips_per_host} "
            f"| {s.gke_accelerator or '-'} | {s.tpu_topology or '-'} | {s.machine_type} |"
        )
    return "\n".join(rows) + "\n"


def local_platform_available(jax_platforms: str) -> bool:
    """Whether this machine has a device for ``JAX_PLATFORMS`` (e.g. ``cuda``, ``tpu``, ``cpu``).

    Cheap checks of device files, no JAX import: the local pool decides before launching whether
    a job asking for a GPU or TPU must fall back to the CPU (with a warning) instead of crashing.
    ``KINETIC_LOCAL_DEVICES`` (e.g. ``cuda``) overrides the detection.
    """
    import glob

    from kinetic_prefect.contract.settings import LOCAL_DEVICES  # here: the module's own imports stay stdlib

    wanted = [p.strip() for p in (jax_platforms or "cpu").split(",") if p.strip()]
    override = LOCAL_DEVICES.value()
    present = {"cpu"}
    if override is not None:
        present |= set(override)
    else:
        if glob.glob("/dev/nvidia[0-9]*"):
            present |= {"cuda", "gpu"}
        if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
            present.add("tpu")
    return all(p in present for p in wanted)


if __name__ == "__main__":
    print(markdown_table(), end="")


def host_count(spec: AcceleratorSpec, hosts: int | None = None) -> int:
    """How many hosts (job processes, pods) run one call: a multi-host slice's own count, else ``hosts``
    (``@kinetic_task(hosts=N)``: N processes of one ``jax.distributed`` group), else 1."""
    if hosts is not None and (isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1):
        raise ValueError(
            f"hosts={hosts!r}: a job runs on at least one host; leave hosts unset (1, or the "
            f"accelerator's own hosts) or give a whole number >= 1, e.g. hosts=2"
        )
    if spec.multi_host:
        if hosts not in (None, spec.hosts):
            raise ValueError(
                f"hosts={hosts}: accelerator {spec.name!r} is a slice of {spec.hosts} hosts; "
                f"hosts={hosts} contradicts it: leave hosts unset, or pick the slice shape with "
                f"{hosts} hosts"
            )
        return spec.hosts
    return hosts or 1
