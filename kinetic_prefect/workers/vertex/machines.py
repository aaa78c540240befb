"""The accelerator catalog on Vertex AI: each entry as the ``MachineSpec`` of a custom job's worker pool, or refused
with the reason and the nearest entry Vertex has.

Sources (docs/vertex.md cites them): the v1 ``AcceleratorType`` enum (the REST reference of ``MachineSpec``, and the
enum of the installed google-cloud-aiplatform, which has no v5p, v6e or TPU7x value); "Training with TPU
accelerators" (Vertex trains on TPU v2, v3 and v5e VMs); "Configure compute resources for custom training" (the
machine types, Spot, reservations, flex-start). A GPU entry keeps the catalog's machine type (the one GKE uses:
N1 with attached GPUs, G2, A2, A3, A4, A4X, G4): Vertex takes the same Compute Engine shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kinetic_prefect import accelerators
from kinetic_prefect.accelerators import AcceleratorSpec

# catalog GKE label -> the Vertex AcceleratorType value's name
GPU_TYPES = {
    "nvidia-tesla-t4": "NVIDIA_TESLA_T4",
    "nvidia-tesla-p4": "NVIDIA_TESLA_P4",
    "nvidia-tesla-p100": "NVIDIA_TESLA_P100",
    "nvidia-tesla-v100": "NVIDIA_TESLA_V100",
    "nvidia-l4": "NVIDIA_L4",
    "nvidia-tesla-a100": "NVIDIA_TESLA_A100",
    "nvidia-a100-80gb": "NVIDIA_A100_80GB",
    "nvidia-h100-80gb": "NVIDIA_H100_80GB",
    "nvidia-h100-mega-80gb": "NVIDIA_H100_MEGA_80GB",
    "nvidia-h200-141gb": "NVIDIA_H200_141GB",
    "nvidia-b200": "NVIDIA_B200",
    "nvidia-gb200": "NVIDIA_GB200",
    "nvidia-rtx-pro-6000": "NVIDIA_RTX_PRO_6000",
}
# TPU families Vertex custom training runs (single-host VMs), by the catalog's GKE label
TPU_TYPES = {"tpu-v5-lite-podslice": "TPU_V5_LITEPOD"}
# Why the other TPU families are refused
TPU_REFUSALS = {
    "tpu-v6e-slice": "the Vertex AI v1 API has no TPU v6e accelerator type (AcceleratorType ends at TPU_V5_LITEPOD)",
    "tpu-v4-podslice": "Vertex custom training documents TPU v2, v3 and v5e VMs, not v4",
    "tpu-v5p-slice": "the Vertex AI v1 API has no TPU v5p accelerator type",
    "tpu7x": "the Vertex AI v1 API has no TPU7x (Ironwood) accelerator type",
}
MULTI_HOST_TPU_REFUSAL = (
    "a multi-host TPU slice is one GKE node pool; Vertex custom jobs are documented here for single-host TPU VMs "
    "only (run the slice on a kinetic-gke pool)"
)


class NotOnVertex(ValueError):
    """A catalog entry Vertex AI custom training cannot run, with the reason and the nearest entry it can."""

    def __init__(self, spec: AcceleratorSpec, reason: str, nearest: str | None):
        self.spec, self.reason, self.nearest = spec, reason, nearest
        hint = f"; the nearest entry Vertex runs is {nearest!r}" if nearest else ""
        super().__init__(f"accelerator {spec.name!r} cannot run on Vertex AI: {reason}{hint}")


@dataclass(frozen=True)
class VertexMachine:
    """One replica's ``MachineSpec``, as the names of the request's fields and enum values."""

    machine_type: str
    accelerator_type: str | None = None  # an AcceleratorType name; None: no accelerator
    accelerator_count: int = 0
    tpu_topology: str | None = None

    def as_request_fields(self) -> dict[str, object]:
        """The ``MachineSpec`` fields, for ``aiplatform_v1.MachineSpec(**fields)``."""
        fields: dict[str, object] = {"machine_type": self.machine_type}
        if self.accelerator_type:
            fields.update(accelerator_type=self.accelerator_type, accelerator_count=self.accelerator_count)
        if self.tpu_topology:
            fields["tpu_topology"] = self.tpu_topology
        return fields


def machine_for(accelerator: str | AcceleratorSpec) -> VertexMachine:
    """The Vertex machine of one host of ``accelerator``; NotOnVertex when Vertex cannot run it."""
    spec = accelerators.resolve(accelerator)
    if spec.family == "cpu":
        return VertexMachine(spec.machine_type)
    if spec.family == "gpu":
        gpu = GPU_TYPES.get(spec.gke_accelerator or "")
        if gpu is None:
            raise NotOnVertex(spec, f"no Vertex accelerator type for {spec.gke_accelerator}", None)
        return VertexMachine(spec.machine_type, gpu, spec.chips_per_host)
    label = spec.gke_accelerator or ""
    if label not in TPU_TYPES:
        raise NotOnVertex(spec, TPU_REFUSALS.get(label, f"no Vertex accelerator type for {label}"), _nearest_tpu(spec))
    if spec.multi_host:
        raise NotOnVertex(spec, MULTI_HOST_TPU_REFUSAL, _nearest_tpu(spec))
    return VertexMachine(spec.machine_type, TPU_TYPES[label], spec.chips_per_host, spec.tpu_topology)


def _nearest_tpu(spec: AcceleratorSpec) -> str | None:
    """The single-host TPU entry Vertex runs whose chip count is nearest ``spec``'s (the larger on a tie)."""
    runnable = [
        s for s in accelerators.catalog() if s.family == "tpu" and s.gke_accelerator in TPU_TYPES and not s.multi_host
    ]
    if not runnable:
        return None
    return min(runnable, key=lambda s: (abs(s.chips - spec.chips), -s.chips)).name


def vertex_catalog() -> list[tuple[AcceleratorSpec, VertexMachine | NotOnVertex]]:
    """Every catalog entry with its Vertex machine or the refusal (docs/vertex.md's table is made from this)."""
    rows: list[tuple[AcceleratorSpec, VertexMachine | NotOnVertex]] = []
    for spec in accelerators.catalog():
        try:
            rows.append((spec, machine_for(spec)))
        except NotOnVertex as refused:
            rows.append((spec, refused))
    return rows


def markdown_table() -> str:
    rows = [
        "| Entry | Vertex machine type | Accelerator type x count | TPU topology | Or why not |",
        "|---|---|---|---|---|",
    ]
    for spec, machine in vertex_catalog():
        if isinstance(machine, NotOnVertex):
            nearest = f" Nearest: `{machine.nearest}`." if machine.nearest else ""
            rows.append(f"| `{spec.name}` | – | – | – | {machine.reason}.{nearest} |")
        else:
            accel = f"{machine.accelerator_type} x {machine.accelerator_count}" if machine.accelerator_type else "–"
            rows.append(f"| `{spec.name}` | {machine.machine_type} | {accel} | {machine.tpu_topology or '–'} | |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
