"""List prices of every entry of the accelerator catalog, with where each figure comes from (stdlib only).

One figure per catalog entry and kind (on-demand, spot), in US dollars per hour, for the default region
(``DEFAULT_REGION``). ``unit`` says what one figure pays for: ``"host"`` is one whole node (a GPU
machine type: its vCPUs, memory and GPUs together, as GKE bills the node), ``"chip"`` one TPU chip (a TPU
slice costs its chips times the chip price; a multi-host slice is the same chip price times all its chips,
each host billed for its own chips). Every catalog entry has a ``Price``; one whose ``on_demand`` and ``spot``
are None has no public price (its ``note`` says why): its runs are metered in minutes and priced at nothing
until a pool gives a figure (``prices`` pool variable, see ``kinetic_prefect.shared.cost.load_prices``).

Sources: every figure below is read from the SkyPilot GCP catalog (``catalogs/v8/gcp/vms.csv`` of
github.com/skypilot-org/skypilot-catalog, commit ``006059e0``), which SkyPilot generates from Google's Cloud
Billing Catalog API. A GPU entry is the sum of two of its rows: the machine type's own row (vCPUs and memory)
and the row of its attached GPUs (``AcceleratorName`` x ``AcceleratorCount``). A TPU chip price is the
source's smallest slice row divided by its chips (the larger slice rows are the same chip price times their
chips). Zone ``us-central1-a`` unless an entry's source names another: P100 is listed in ``us-central1-c``
only, H200 in ``us-central1-b``, and TPU v4 outside us-central1 altogether (``us-central2-b``). Read on
2026-12-03 (the l4, a100 and tpu-v6e rows also on 2026-12-01). Spot prices change (Google may change them
once a day) and the list prices exclude discounts: give a pool its own ``prices`` for another region, a
committed-use discount or a private price sheet.

No public price (``on_demand``/``spot`` None), and why:

- ``a100-80gb`` (every size): the source's A100-80GB rows give a spot figure above the on-demand one in
  us-central1 (1 GPU: 1.964 spot, 1.8462 on demand), so neither is trusted.
- ``b200x8``: the source has a B200 x 8 row, but its ``a4-highgpu-8g`` machine row reads 0.0, so the whole
  node's price is not known (GKE bills the node, not the GPUs alone).
- ``gb200x4`` (A4X), ``rtx-pro-6000`` (G4, every size) and TPU7x (every size): the source has no row for them.
- ``cpu``: on ``kinetic-local`` the machine is yours; on GKE the node type is the pool's choice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kinetic_prefect import accelerators

DEFAULT_REGION = "us-central1"
CATALOG_FILE = "SkyPilot GCP catalog catalogs/v8/gcp/vms.csv @006059e0 (from the Cloud Billing Catalog API)"
SOURCE = f"{CATALOG_FILE}, us-central1-a"
SOURCE_DATE = "2026-12-03"
NO_PUBLIC_PRICE = "no public price"


@dataclass(frozen=True)
class Price:
    """US dollars per hour of one ``unit`` ("host": a whole node; "chip": one TPU chip)."""

    on_demand: float | None
    spot: float | None
    unit: str = "host"
    source: str = SOURCE
    date: str = SOURCE_DATE
    note: str = ""

    def rate(self, spot: bool) -> float | None:
        return self.spot if spot else self.on_demand

    @property
    def priced(self) -> bool:
        return self.on_demand is not None or self.spot is not None


Row = tuple[float, float]  # (on-demand, spot) of one source row


def _gpu(machine: Row, gpus: Row, note: str, zone: str = "us-central1-a") -> Price:
    """A GPU node: the machine type's row plus its GPUs' row, each (on-demand, spot)."""
    on_demand, spot = round(machine[0] + gpus[0], 5), round(machine[1] + gpus[1], 5)
    return Price(on_demand, spot, "host", f"{CATALOG_FILE}, {zone}", note=note)


def _unpriced(why: str, unit: str = "host") -> Price:
    return Price(None, None, unit, note=f"{NO_PUBLIC_PRICE}: {why}")


# Machine rows (vCPUs and memory), (on-demand, spot), us-central1-a unless noted.
_N1 = {8: (0.38, 0.10446), 16: (0.76, 0.20892), 32: (1.51999, 0.41784), 64: (3.03998, 0.83568)}
_G2 = {8: (0.29358, 0.11747), 24: (0.88075, 0.35242), 48: (1.7615, 0.70483), 96: (3.52301, 1.40966)}
_A2 = {1: (0.73948, 0.36975), 2: (1.47895, 0.7395), 4: (2.95791, 1.479), 8: (5.91582, 2.958), 16: (8.79698, 4.39824)}
_A3_HIGH = {1: (1.18251, 0.36117), 2: (2.36502, 0.72233), 4: (4.73003, 1.44466), 8: (9.46006, 2.88933)}
_A3_MEGA_8G = (9.46006, 2.88933)
_A3_ULTRA_8G = (12.266, 3.74713)  # us-central1-b: the only us-central1 zone the source lists

# GPU rows, {count: (on-demand, spot)}, us-central1-a unless noted.
_T4 = {1: (0.35, 0.175), 2: (0.7, 0.35), 4: (1.4, 0.7)}
_P4 = {1: (0.6, 0.2236), 2: (1.2, 0.4472), 4: (2.4, 0.8944)}
_P100 = {1: (1.46, 0.7034), 2: (2.92, 1.4068), 4: (5.84, 2.8136)}  # us-central1-c
_V100 = {1: (2.48, 1.0885), 2: (4.96, 2.177), 4: (9.92, 4.354), 8: (19.84, 8.708)}
_L4 = {1: (0.56004, 0.2231), 2: (1.12008, 0.4462), 4: (2.24016, 0.8924), 8: (4.48032, 1.7848)}
_A100 = {
    1: (2.93391, 1.4341),
    2: (5.86782, 2.8682),
    4: (11.73563, 5.7364),
    8: (23.47126, 11.4728),
    16: (46.94253, 22.9456),
}
_H100 = {1: (4.20076, 2.9926), 2: (8.40152, 5.9852), 4: (16.80304, 11.9704), 8: (33.60609, 23.9408)}
_H100_MEGA_8 = (82.75421, 25.2808)
_H200_8 = (74.49392, 37.2472)  # us-central1-b

# TPU chip prices (on-demand, spot), from the smallest slice row of each generation.
_TPU_CHIP: dict[str, tuple[float, float, str, str]] = {
    "tpu-v4-podslice": (3.22, 0.9215, "us-central2-b", "TPU v4, per chip-hour (tpu-v4-8 row, 4 chips: 12.88 / 3.686)"),
    "tpu-v5-lite-podslice": (1.2, 0.24493, "us-central1-a", "TPU v5e, per chip-hour (tpu-v5litepod-1 row)"),
    "tpu-v5p-slice": (4.2, 0.8357, "us-central1-a", "TPU v5p, per chip-hour (tpu-v5p-8 row, 4 chips: 16.8 / 3.3428)"),
    "tpu-v6e-slice": (2.7, 0.54421, "us-central1-a", "TPU v6e (Trillium), per chip-hour (tpu-v6e-1 row)"),
}


def _gpu_family(short: str, label: str, machines: dict[int, Row], gpus: dict[int, Row], zone: str) -> dict[str, Price]:
    """Every size of one GPU family: ``machines`` and ``gpus`` map a GPU count to its (on-demand, spot) rows."""
    found = {}
    for count, gpu_row in gpus.items():
        spec = accelerators.resolve(short if count == 1 else f"{short}x{count}")
        where = "" if zone == "us-central1-a" else f" ({zone})"
        found[spec.name] = _gpu(machines[count], gpu_row, f"{spec.machine_type} + {count} x {label}{where}", zone)
    return found


def _gpu_prices() -> dict[str, Price]:
    n1 = {1: _N1[8], 2: _N1[16], 4: _N1[32], 8: _N1[64]}  # the catalog's N1 host for each GPU count
    g2 = {1: _G2[8], 2: _G2[24], 4: _G2[48], 8: _G2[96]}
    central_a = "us-central1-a"
    return {
        **_gpu_family("t4", "T4", n1, _T4, central_a),
        **_gpu_family("p4", "P4", n1, _P4, central_a),
        **_gpu_family("p100", "P100", n1, _P100, "us-central1-c"),
        **_gpu_family("v100", "V100", n1, _V100, central_a),
        **_gpu_family("l4", "L4", g2, _L4, central_a),
        **_gpu_family("a100", "A100 40GB", _A2, _A100, central_a),
        **_gpu_family("h100", "H100 80GB", _A3_HIGH, _H100, central_a),
        "h100-megax8": _gpu(_A3_MEGA_8G, _H100_MEGA_8, "a3-megagpu-8g + 8 x H100 80GB Mega", central_a),
        "h200x8": _gpu(_A3_ULTRA_8G, _H200_8, "a3-ultragpu-8g + 8 x H200 141GB (us-central1-b)", "us-central1-b"),
    }


def _tpu_price(spec: accelerators.AcceleratorSpec) -> Price:
    if spec.gke_accelerator not in _TPU_CHIP:
        return _unpriced("the source has no TPU7x row", "chip")
    on_demand, spot, zone, note = _TPU_CHIP[spec.gke_accelerator]
    return Price(on_demand, spot, "chip", f"{CATALOG_FILE}, {zone}", note=note)


_NOT_IN_SOURCE = {
    "a100-80gb": "the source's A100-80GB rows give a spot figure above the on-demand one (1 GPU: 1.964 > 1.8462)",
    "b200": "the source's a4-highgpu-8g machine row reads 0.0, so the whole node's price is not known",
    "gb200": "the source has no GB200 (A4X) row",
    "rtx-pro-6000": "the source has no RTX PRO 6000 (G4) row",
}


def _build() -> dict[str, Price]:
    gpus = _gpu_prices()
    found: dict[str, Price] = {}
    for spec in accelerators.catalog():
        if spec.family == "cpu":
            found[spec.name] = _unpriced("on kinetic-local the machine is yours; on GKE the node type is the pool's")
        elif spec.family == "tpu":
            found[spec.name] = _tpu_price(spec)
        elif spec.name in gpus:
            found[spec.name] = gpus[spec.name]
        else:
            family = next(
                (key for key in _NOT_IN_SOURCE if spec.name in (key, *(f"{key}x{n}" for n in (2, 4, 8)))), None
            )
            if not family:  # a new catalog entry: it needs its figures or the reason it has none
                raise AssertionError(f"accelerator {spec.name!r} has no entry in prices.py: add its rows or its reason")
            found[spec.name] = _unpriced(_NOT_IN_SOURCE[family])
    return found


PRICES: dict[str, Price] = _build()


# Vertex AI custom training (kinetic-vertex) bills its own rates, per machine type and per accelerator, not
# Compute Engine's (https://cloud.google.com/vertex-ai/pricing, "custom-trained models", training). Vertex's figure of a
# catalog entry, (on-demand, spot) in US dollars per hour of one host in us-central1 with its source, goes here when
# both its machine type's and its accelerators' training rates are known from a source. None is yet: the figures the
# sources read for this table give (docs/vertex.md, "Prices") are n1-standard-4 training at 0.21849885/h in
# us-central1 (no catalog entry is an n1-standard-4 host) and an NVIDIA_H100_80GB training rate of 9.79655057/h whose
# region the source does not state; the rates of g2-standard-*, NVIDIA_L4, a2/a3, T4, V100, the TPUs and Vertex's
# Spot rates were not in them. An entry without a Vertex figure is priced at its Compute Engine figure (the table
# above), its source saying so; a pool's ``prices`` gives a kinetic-vertex pool its own.
VERTEX_TRAINING: dict[str, tuple[Row, str]] = {}
VERTEX_FALLBACK = "Compute Engine list price (no Vertex AI training rate in kinetic's table yet, docs/vertex.md)"


def vertex_prices(rates: dict[str, tuple[Row, str]]) -> dict[str, Price]:
    """The table a kinetic-vertex job is priced at: ``rates``' Vertex figure for an entry that has one, else the
    entry's Compute Engine figure with its source naming it as the fallback."""
    found: dict[str, Price] = {}
    for name, price in PRICES.items():
        if name in rates:
            (on_demand, spot), source = rates[name]
            found[name] = Price(on_demand, spot, "host", source, note=f"Vertex AI custom training: {source}")
        elif price.priced:
            found[name] = replace(price, source=f"{VERTEX_FALLBACK}; {price.source}")
        else:
            found[name] = price
    return found


VERTEX_PRICES: dict[str, Price] = vertex_prices(VERTEX_TRAINING)


def _figure(value: float | None) -> str:
    return "-" if value is None else str(value)


def markdown_table() -> str:
    """The price table as Markdown (docs/cost.md shows it; a test keeps the two the same)."""
    rows = [
        f"| accelerator | on-demand $/h | spot $/h | per | made of / why not priced ({DEFAULT_REGION}) |",
        "| --- | ---: | ---: | --- | --- |",
    ]
    for name, price in PRICES.items():
        rows.append(f"| `{name}` | {_figure(price.on_demand)} | {_figure(price.spot)} | {price.unit} | {price.note} |")
    return "\n".join(rows) + "\n"


__all__ = [
    "DEFAULT_REGION",
    "NO_PUBLIC_PRICE",
    "PRICES",
    "VERTEX_FALLBACK",
    "VERTEX_PRICES",
    "VERTEX_TRAINING",
    "Price",
    "markdown_table",
    "vertex_prices",
]
