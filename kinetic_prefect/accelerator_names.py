"""Accelerator names as Keras Kinetic reads them, mapped onto this project's catalog (``accelerators.py``).

The two namings agree on GPUs and on v5e, and disagree on TPU slices named by a number: Kinetic counts
**chips** in every TPU name (``v5p-8`` is a 2x2x2 slice, 8 chips on 2 hosts; ``v6e-8`` is 2x4 on two
``ct6e-standard-4t`` hosts), this catalog follows GKE and Cloud TPU (``tpu-v5p-8`` counts TensorCores: 4 chips,
1 host; ``tpu-v6e-8`` is one ``ct6e-standard-8t`` host). The ``kinetic`` API reads names Kinetic's way, so
ported code gets the hardware it got before; ``@kinetic_task`` reads them GKE's way and warns once where the
two readings of a name differ (:func:`warn_if_read_differently`).

Stdlib only (with ``accelerators``): the decorator imports it at decoration time.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

from kinetic_prefect import accelerators
from kinetic_prefect.accelerators import AcceleratorSpec, UnknownAcceleratorError


@dataclass(frozen=True)
class KineticTpuShape:
    """One slice size of a TPU type as Kinetic defines it (its docs/accelerators.md table)."""

    chips: int
    topology: str
    machine_type: str
    hosts: int


def _shapes(rows: str) -> dict[int, KineticTpuShape]:
    """``"chips topology machine hosts; ..."`` → shapes by chip count."""
    shapes = {}
    for row in rows.split(";"):
        chips, topology, machine, hosts = row.split()
        shapes[int(chips)] = KineticTpuShape(int(chips), topology, machine, int(hosts))
    return shapes


# TPU type -> (GKE accelerator label, the chip count of the bare type name, shapes). Facts from Kinetic's docs.
TPU_FAMILIES_KINETIC: dict[str, tuple[str, int, dict[int, KineticTpuShape]]] = {
    "v3": (
        "tpu-v3-podslice",
        4,
        _shapes(
            "4 2x2 ct3-hightpu-4t 1; 16 4x4 ct3p-hightpu-4t 4; 32 4x8 ct3p-hightpu-4t 8; 64 8x8 ct3p-hightpu-4t 16;"
            "128 8x16 ct3p-hightpu-4t 32; 256 16x16 ct3p-hightpu-4t 64; 512 16x32 ct3p-hightpu-4t 128;"
            "1024 32x32 ct3p-hightpu-4t 256; 2048 32x64 ct3p-hightpu-4t 512"
        ),
    ),
    "v4": (
        "tpu-v4-podslice",
        4,
        _shapes(
            "4 2x2x1 ct4p-hightpu-4t 1; 8 2x2x2 ct4p-hightpu-4t 2; 16 2x2x4 ct4p-hightpu-4t 4;"
            "32 2x4x4 ct4p-hightpu-4t 8; 64 4x4x4 ct4p-hightpu-4t 16; 128 4x4x8 ct4p-hightpu-4t 32;"
            "256 4x8x8 ct4p-hightpu-4t 64; 512 8x8x8 ct4p-hightpu-4t 128; 1024 8x8x16 ct4p-hightpu-4t 256;"
            "2048 8x16x16 ct4p-hightpu-4t 512; 4096 16x16x16 ct4p-hightpu-4t 1024"
        ),
    ),
    "v5litepod": (
        "tpu-v5-lite-podslice",
        4,
        _shapes(
            "1 1x1 ct5lp-hightpu-1t 1; 4 2x2 ct5lp-hightpu-4t 1; 8 2x4 ct5lp-hightpu-8t 1; 16 4x4 ct5lp-hightpu-4t 4;"
            "32 4x8 ct5lp-hightpu-4t 8; 64 8x8 ct5lp-hightpu-4t 16; 128 8x16 ct5lp-hightpu-4t 32;"
            "256 16x16 ct5lp-hightpu-4t 64"
        ),
    ),
    "v5p": (
        "tpu-v5p-slice",
        8,
        _shapes("8 2x2x2 ct5p-hightpu-4t 2; 16 2x2x4 ct5p-hightpu-4t 4; 32 2x4x4 ct5p-hightpu-4t 8"),
    ),
    "v6e": ("tpu-v6e-slice", 8, _shapes("8 2x4 ct6e-standard-4t 2; 16 4x4 ct6e-standard-4t 4")),
}
_TPU_ALIASES = {"v5e": "v5litepod"}
# What Kinetic picks for a bare count ("gpu:4", "tpu:8"): the most capable type that has it.
_GPU_PREFERENCE = ("h100", "a100-80gb", "a100", "l4", "v100", "t4", "p100", "p4")
_TPU_PREFERENCE = ("v6e", "v5p", "v5litepod", "v4", "v3")
_KINETIC_GPUS = {
    "l4": "nvidia-l4",
    "t4": "nvidia-tesla-t4",
    "v100": "nvidia-tesla-v100",
    "a100": "nvidia-tesla-a100",
    "a100-80gb": "nvidia-a100-80gb",
    "h100": "nvidia-h100-80gb",
    "p4": "nvidia-tesla-p4",
    "p100": "nvidia-tesla-p100",
}
_GPU_BY_LABEL = {label: short for short, label in _KINETIC_GPUS.items()}
_MULTI_GPU = re.compile(r"([^x]+)x(\d+)")
_TPU_TOPOLOGY = re.compile(r"([a-z0-9_]+)-(\d+x\d+(?:x\d+)?)")
_TPU_CHIPS = re.compile(r"([a-z0-9_]+)-(\d+)")


def _gpu(raw: str, short: str, count: int) -> AcceleratorSpec:
    try:
        return accelerators.resolve(short if count == 1 else f"{short}x{count}")
    except UnknownAcceleratorError as exc:
        raise UnknownAcceleratorError(f"Kinetic accelerator {raw!r} ({count} x {short}): {exc}") from None


def _tpu(raw: str, family: str, shape: KineticTpuShape) -> AcceleratorSpec:
    label = TPU_FAMILIES_KINETIC[family][0]
    for spec in accelerators.catalog():
        if spec.gke_accelerator == label and spec.tpu_topology == shape.topology and spec.hosts == shape.hosts:
            return spec
    same_chips = [s.name for s in accelerators.catalog() if s.family == "tpu" and s.chips == shape.chips][:4]
    why = (
        "TPU v3 is not in this catalog (GKE runs v4, v5e, v5p, v6e and TPU7x)"
        if family == "v3"
        else f"this catalog has no {shape.topology} slice of {family}"
    )
    nearest = f"; the nearest with {shape.chips} chips: {', '.join(same_chips)}" if same_chips else ""
    raise UnknownAcceleratorError(
        f"Kinetic accelerator {raw!r} ({family}, {shape.chips} chips, {shape.topology} on "
        f"{shape.hosts} host(s)): {why}{nearest}. Run `kinetic-prefect accelerators`."
    )


def _tpu_by_chips(raw: str, family: str, chips: int) -> AcceleratorSpec:
    shapes = TPU_FAMILIES_KINETIC[family][2]
    if chips not in shapes:
        raise UnknownAcceleratorError(
            f"Kinetic accelerator {raw!r}: {family} comes in {sorted(shapes)} chips "
            f"(Kinetic counts chips in TPU names), e.g. {family}-{min(shapes)}."
        )
    return _tpu(raw, family, shapes[chips])


def kinetic_reading(name: str | AcceleratorSpec) -> AcceleratorSpec:
    """The catalog entry for an accelerator name read as Keras Kinetic reads it (an AcceleratorSpec as is)."""
    if isinstance(name, AcceleratorSpec):
        return name
    if not isinstance(name, str):
        raise TypeError(f"accelerator must be a str, not {type(name).__name__}")
    spec = _read(name, name.strip().lower().removesuffix(":spot").strip())
    return spec.with_spot(True) if name.strip().lower().endswith(":spot") else spec


def _read(raw: str, s: str) -> AcceleratorSpec:
    for prefix in ("gpu", "tpu"):  # gpu-l4 and gpu:l4 are the same name
        if s.startswith(f"{prefix}-"):
            s = f"{prefix}:{s[4:]}"
    if s == "cpu" or re.fullmatch(r"cpu:\d+", s):
        return accelerators.resolve("cpu")
    if s == "gpu":
        return _gpu(raw, "l4", 1)
    if s == "tpu":
        return _tpu_by_chips(raw, "v5litepod", TPU_FAMILIES_KINETIC["v5litepod"][1])
    kind, _, rest = s.partition(":") if s[:4] in ("gpu:", "tpu:") else ("", "", s)
    if kind in ("", "gpu"):
        if rest.isdigit():
            count = int(rest)
            for short in _GPU_PREFERENCE:
                if _fits_gpu(short, count):
                    return _gpu(raw, short, count)
            if kind:
                raise UnknownAcceleratorError(f"Kinetic accelerator {raw!r}: no GPU type comes {count} to a node.")
        short = _GPU_BY_LABEL.get(rest, rest)
        if short in _KINETIC_GPUS:
            return _gpu(raw, short, 1)
        if m := _MULTI_GPU.fullmatch(rest):
            short = _GPU_BY_LABEL.get(m.group(1), m.group(1))
            if short in _KINETIC_GPUS:
                return _gpu(raw, short, int(m.group(2)))
        if kind:
            raise UnknownAcceleratorError(
                f"Kinetic accelerator {raw!r}: unknown GPU; Kinetic's GPUs are "
                f"{', '.join(_KINETIC_GPUS)} (with xN for N per node)."
            )
    if rest.isdigit():
        chips = int(rest)
        for family in _TPU_PREFERENCE:
            if chips in TPU_FAMILIES_KINETIC[family][2]:
                return _tpu_by_chips(raw, family, chips)
    family = _TPU_ALIASES.get(rest, rest)
    if family in TPU_FAMILIES_KINETIC:
        return _tpu_by_chips(raw, family, TPU_FAMILIES_KINETIC[family][1])
    if m := _TPU_TOPOLOGY.fullmatch(rest):
        family = _TPU_ALIASES.get(m.group(1), m.group(1))
        if family in TPU_FAMILIES_KINETIC:
            for shape in TPU_FAMILIES_KINETIC[family][2].values():
                if shape.topology == m.group(2):
                    return _tpu(raw, family, shape)
            raise UnknownAcceleratorError(
                f"Kinetic accelerator {raw!r}: {family} comes in the topologies "
                f"{', '.join(s.topology for s in TPU_FAMILIES_KINETIC[family][2].values())}."
            )
    if m := _TPU_CHIPS.fullmatch(rest):
        family = _TPU_ALIASES.get(m.group(1), m.group(1))
        if family in TPU_FAMILIES_KINETIC:
            return _tpu_by_chips(raw, family, int(m.group(2)))
    raise UnknownAcceleratorError(
        f"Unknown Kinetic accelerator {raw!r}. Kinetic's names: cpu; GPUs {', '.join(_KINETIC_GPUS)} (l4x2, gpu:4); "
        f"TPUs {', '.join(TPU_FAMILIES_KINETIC)} with a chip count or topology (v5litepod-4, v6e-2x4, tpu:8)."
    )


def _fits_gpu(short: str, count: int) -> bool:
    try:
        accelerators.resolve(short if count == 1 else f"{short}x{count}")
        return True
    except UnknownAcceleratorError:
        return False


def both_readings(name: str) -> tuple[AcceleratorSpec | None, AcceleratorSpec | None]:
    """``(this catalog's reading, Kinetic's reading)`` of ``name``; None where that naming has no such name."""
    readings: list[AcceleratorSpec | None] = []
    for read in (accelerators.resolve, kinetic_reading):
        try:
            readings.append(read(name))
        except (UnknownAcceleratorError, TypeError, ValueError):
            readings.append(None)
    return readings[0], readings[1]


def _hardware(spec: AcceleratorSpec) -> tuple:
    return spec.family, spec.gke_accelerator, spec.chips, spec.tpu_topology, spec.hosts


def describe(spec: AcceleratorSpec) -> str:
    if spec.family == "gpu":
        return f"{spec.chips} x {spec.gke_accelerator} on 1 host"
    if spec.family != "tpu":
        return spec.name
    return f"{spec.chips} chips ({spec.tpu_topology}) on {spec.hosts} host{'s' if spec.hosts > 1 else ''}"


def read_differently(name: str) -> str | None:
    """Why ``name`` means other hardware to Kinetic than here (naming the unambiguous spellings), else None."""
    ours, theirs = both_readings(name)
    if ours is None or theirs is None or _hardware(ours) == _hardware(theirs):
        return None
    unambiguous = next((c for c in _spellings_of(ours) if _agree(c)), ours.name)
    return (
        f"accelerator {name!r} is read as GKE names it: {ours.name}, {describe(ours)}. Keras Kinetic reads the "
        f"same name as {describe(theirs)}, which is {theirs.name!r} here. Write {unambiguous!r} to keep this "
        f"reading, {theirs.name!r} for Kinetic's, or use kinetic_prefect.kinetic.run (Kinetic's reading)."
    )


def _agree(name: str) -> bool:
    ours, theirs = both_readings(name)
    return ours is not None and (theirs is None or _hardware(ours) == _hardware(theirs))


def _spellings_of(spec: AcceleratorSpec) -> list[str]:
    """Other names of ``spec`` in this catalog: by topology (``tpu-v5p-2x2x1``), by GKE label (``tpu-v6e-slice-8``)."""
    if not spec.tpu_topology:
        return []
    family, size = spec.name.rsplit("-", 1)
    return [f"{family}-{spec.tpu_topology}", f"{spec.gke_accelerator}-{size}"]


_warned: set[str] = set()


class AcceleratorNamingWarning(UserWarning):
    """An accelerator name means other hardware to Keras Kinetic than to this catalog."""


def warn_if_read_differently(name: object) -> None:
    """Once per name and process: the name means other hardware in Kinetic's naming than in this catalog's."""
    if not isinstance(name, str) or name in _warned:
        return
    message = read_differently(name)
    if message is not None:
        _warned.add(name)
        warnings.warn(message, AcceleratorNamingWarning, stacklevel=4)


def naming_table(names: list[str]) -> str:
    """A Markdown table of both readings of each name (what the "Coming from Kinetic" page shows)."""
    rows = ["| name | Kinetic reads it as | = here | this catalog reads it as |", "| --- | --- | --- | --- |"]
    for name in names:
        ours, theirs = both_readings(name)
        rows.append(
            f"| `{name}` | {describe(theirs) if theirs else '(not a Kinetic name)'} "
            f"| {f'`{theirs.name}`' if theirs else '-'} | "
            f"{f'`{ours.name}`, {describe(ours)}' if ours else '(not a name here)'} |"
        )
    return "\n".join(rows) + "\n"


__all__ = [
    "AcceleratorNamingWarning",
    "TPU_FAMILIES_KINETIC",
    "both_readings",
    "kinetic_reading",
    "naming_table",
    "read_differently",
    "warn_if_read_differently",
]
