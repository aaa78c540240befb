"""List prices of the accelerator catalog's entries, with where each figure comes from (stdlib only).

One figure per catalog entry and kind (on-demand, spot), in US dollars per hour, for the default region
(``DEFAULT_REGION``). ``unit`` says what one figure pays for: ``"host"`` is one whole node (a GPU
machine type: its vCPUs, memory and GPUs together, as GKE bills the node), ``"chip"`` one TPU chip (a TPU
slice costs its chips times the chip price; a multi-host slice is billed per host's chips). An entry
that is not in ``PRICES`` has no default price: its runs are metered in minutes and priced at nothing
until a pool gives a figure (``prices`` pool variable, see ``kinetic_prefect.shared.cost.load_prices``).

Sources: every figure below is the sum of the rows of the SkyPilot GCP catalog
(``catalogs/v8/gcp/vms.csv`` of github.com/skypilot-org/skypilot-catalog, commit ``006059e0``), which is
generated from Google's Cloud Billing Catalog API: for a GPU machine type the machine's own row (vCPUs and
memory) plus the row of its attached GPUs, in zone ``us-central1-a``. Read on 2026-12-01. Spot prices
change (Google may change them once a day) and the list prices exclude discounts: give a pool its own
``prices`` for another region, a committed-use discount or a private price sheet.

Not priced here (no figure found in the source for us-central1, or the figure is implausible there):
``t4``/``p4``/``p100``/``v100`` (their N1 host machine's row was not read), ``a100-80gb`` (the source's spot
figure is above its on-demand one), ``h100``/``h100-mega``/``h200``/``b200``/``gb200``/``rtx-pro-6000``, the
multi-GPU ``l4`` shapes (their G2 machine rows were not read), TPU v4, v5e, v5p and TPU7x, and ``cpu`` (on
``kinetic-local`` the machine is yours; on GKE the node type is the pool's choice).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_REGION = "us-central1"
SOURCE = "SkyPilot GCP catalog catalogs/v8/gcp/vms.csv @006059e0 (from the Cloud Billing Catalog API), us-central1-a"
SOURCE_DATE = "2026-12-01"


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


def _gpu(machine: tuple[float, float], gpus: tuple[float, float], note: str) -> Price:
    """A GPU node: the machine type's row plus its GPUs' row, each (on-demand, spot)."""
    return Price(round(machine[0] + gpus[0], 5), round(machine[1] + gpus[1], 5), "host", note=note)


PRICES: dict[str, Price] = {
    "l4": _gpu((0.29358, 0.11747), (0.56004, 0.2231), "g2-standard-8 + 1 x L4"),
    "a100": _gpu((0.73948, 0.36975), (2.93391, 1.4341), "a2-highgpu-1g + 1 x A100 40GB"),
    "a100x2": _gpu((1.47895, 0.7395), (5.86782, 2.8682), "a2-highgpu-2g + 2 x A100 40GB"),
    "a100x4": _gpu((2.95791, 1.479), (11.73563, 5.7364), "a2-highgpu-4g + 4 x A100 40GB"),
    "a100x8": _gpu((5.91582, 2.958), (23.47126, 11.4728), "a2-highgpu-8g + 8 x A100 40GB"),
    # TPU v6e (Trillium): the source's tpu-v6e-N rows are N times the one-chip figure in every size.
    **{
        name: Price(2.7, 0.54421, "chip", note="TPU v6e, per chip-hour (tpu-v6e-1 row)")
        for name in (
            "tpu-v6e-1",
            "tpu-v6e-4",
            "tpu-v6e-8",
            "tpu-v6e-16",
            "tpu-v6e-32",
            "tpu-v6e-64",
            "tpu-v6e-128",
            "tpu-v6e-256",
        )
    },
}


def markdown_table() -> str:
    """The price table as Markdown (the cost page of the docs shows it)."""
    rows = [
        f"| accelerator | on-demand $/h | spot $/h | per | what | source ({DEFAULT_REGION}, read {SOURCE_DATE}) |",
        "| --- | ---: | ---: | --- | --- | --- |",
    ]
    for name, price in PRICES.items():
        rows.append(f"| `{name}` | {price.on_demand} | {price.spot} | {price.unit} | {price.note} | {price.source} |")
    return "\n".join(rows) + "\n"


__all__ = ["DEFAULT_REGION", "PRICES", "Price"]
