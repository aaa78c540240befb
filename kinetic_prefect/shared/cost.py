"""What a job costs: its hosts' running time against the price table (stdlib only, no Prefect).

The worker meters a job from each host's start (the process, the pod) to its end, at the rate the host ran at
(spot or on-demand), per host: a group of two hosts costs twice one host. Prices come from
the built-in table the pool's launcher names (``LauncherAbilities.price_source``: ``TABLES``) unless the pool
overrides them (``load_prices``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kinetic_prefect import accelerators
from kinetic_prefect.contract.launchers import PriceSource
from kinetic_prefect.shared.prices import PRICES, VERTEX_PRICES, Price

# the built-in price table of each price source a launcher may name
TABLES: dict[PriceSource, dict[str, Price]] = {
    PriceSource.CLOUD_CATALOG: PRICES,
    PriceSource.VERTEX_CATALOG: VERTEX_PRICES,
}


class PriceTableError(ValueError):
    """A pool's ``prices`` (or a ``max_cost_usd``) cannot be used; the message names the entry and the fix."""


@dataclass(frozen=True)
class HostSpan:
    """One host of a job: when it started and ended (epoch seconds; ``end`` None while it runs) and whether it
    ran on a spot node. ``running``: when its program began to run, where the launcher can tell (a GKE pod's
    container ``startedAt``; from ``start`` to there the node pulled the image): None when unknown."""

    start: float
    end: float | None = None
    spot: bool = False
    running: float | None = None

    def seconds(self, now: float) -> float:
        return max(0.0, (self.end if self.end is not None else now) - self.start)

    def pending_seconds(self, now: float) -> float | None:
        """Billed but not running yet (image pull, container start); None where the launcher cannot tell."""
        if self.running is None:
            return None
        return max(0.0, min(self.running, self.end if self.end is not None else now) - self.start)


@dataclass
class JobCost:
    """The metered cost of one job so far (``usd`` None: no price for its accelerator on this pool)."""

    accelerator: str
    spot: bool
    hosts: int
    minutes: float  # wall-clock minutes from the first host's start to the last one's end (or now)
    host_minutes: float  # summed over hosts: what is billed
    usd_per_hour: float | None  # the whole job's rate (every host)
    usd: float | None
    price_source: str = ""
    ended: bool = False

    def as_row(self, call: str) -> dict[str, Any]:
        return {
            "call": call,
            "accelerator": self.accelerator,
            "spot": self.spot,
            "hosts": self.hosts,
            "minutes": round(self.minutes, 4),
            "usd_per_hour": self.usd_per_hour,
            "usd": None if self.usd is None else round(self.usd, 6),
            "price": self.price_source,
        }


def check_budget(max_cost_usd: Any, what: str = "max_cost_usd") -> float | None:
    """``max_cost_usd`` as a positive number, or None (no budget); anything else fails naming the fix."""
    if max_cost_usd is None:
        return None
    if (
        isinstance(max_cost_usd, bool)
        or not isinstance(max_cost_usd, (int, float))
        or not math.isfinite(max_cost_usd)
        or max_cost_usd <= 0
    ):
        raise PriceTableError(
            f"{what}={max_cost_usd!r}: a budget is a positive number of US dollars, e.g. "
            f"{what}=2.5; leave it unset for no budget"
        )
    return float(max_cost_usd)


def _price_entry(name: str, raw: Any, origin: str) -> tuple[str, Price]:
    try:
        spec = accelerators.resolve(name)
    except accelerators.UnknownAcceleratorError as exc:
        raise PriceTableError(f"{origin}: entry {name!r}: {exc}") from None
    if not isinstance(raw, dict):
        raise PriceTableError(
            f"{origin}: entry {name!r} must be an object such as "
            '{"on_demand": 0.85, "spot": 0.34, "unit": "host"}, not ' + repr(raw)
        )
    unknown = set(raw) - {"on_demand", "spot", "unit", "source", "date", "note"}
    if unknown:
        raise PriceTableError(
            f"{origin}: entry {name!r} has unknown field(s) {', '.join(sorted(unknown))} "
            "(known: on_demand, spot, unit, source, date, note)"
        )
    figures = {}
    for kind in ("on_demand", "spot"):
        value = raw.get(kind)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise PriceTableError(f"{origin}: entry {name!r}: {kind}={value!r} is not a price in US dollars per hour")
        figures[kind] = None if value is None else float(value)
    unit = raw.get("unit", "host")
    if unit not in ("host", "chip"):
        raise PriceTableError(
            f'{origin}: entry {name!r}: unit={unit!r}; use "host" (a whole node) or "chip" (one TPU chip)'
        )
    return spec.name, Price(
        figures["on_demand"],
        figures["spot"],
        unit,
        source=str(raw.get("source") or origin),
        date=str(raw.get("date") or ""),
        note=str(raw.get("note") or ""),
    )


def load_prices(value: Any, origin: str = "the pool's prices") -> dict[str, Price]:
    """A pool's ``prices`` variable: an object ``{"l4": {"on_demand": 0.9, "spot": 0.3}, ...}``, that object as
    JSON text, or the path of a JSON file holding it. Names are catalog names (``l4``, ``tpu-v6e-8``, ``cpu``)."""
    if value in (None, "", {}):
        return {}
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("{"):
            path = Path(text).expanduser()
            try:
                text = path.read_text()
            except OSError as exc:
                raise PriceTableError(
                    f"{origin}: cannot read price file {str(path)!r} ({exc.strerror or exc}); give "
                    "a JSON file's path or the JSON object itself"
                ) from None
            origin = f"price file {path}"
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise PriceTableError(f"{origin}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise PriceTableError(
            f'{origin} must map accelerator names to prices, e.g. {{"l4": {{"on_demand": 0.85, "spot": 0.34}}}}'
        )
    return dict(_price_entry(str(name), raw, origin) for name, raw in value.items())


def price_for(
    spec: accelerators.AcceleratorSpec,
    overrides: dict[str, Price] | None = None,
    source: PriceSource = PriceSource.CLOUD_CATALOG,
) -> Price | None:
    """The pool's price for ``spec``, else the one of the built-in table of ``source`` (the pool's launcher's);
    None where neither has a figure (a built-in table keeps a figure-less entry for every accelerator with no
    public price, its note saying why)."""
    found = (overrides or {}).get(spec.name) or TABLES[source].get(spec.name)
    return found if found is not None and found.priced else None


def host_rate(spec: accelerators.AcceleratorSpec, price: Price | None, spot: bool) -> float | None:
    """US dollars per hour of one host of ``spec``."""
    rate = price.rate(spot) if price is not None else None
    if rate is None:
        return None
    assert price is not None  # a rate came from it
    return rate * (max(1, spec.chips_per_host) if price.unit == "chip" else 1)


def job_cost(spec: accelerators.AcceleratorSpec, spans: list[HostSpan], price: Price | None, now: float) -> JobCost:
    """The cost of a job whose hosts ran ``spans`` (each at its own spot or on-demand rate)."""
    spot = all(span.spot for span in spans) if spans else spec.spot
    usd: float | None = 0.0
    rate_total: float | None = 0.0
    for span in spans:
        rate = host_rate(spec, price, span.spot)
        if rate is None or usd is None or rate_total is None:
            usd = rate_total = None
            break
        usd += rate * span.seconds(now) / 3600.0
        rate_total += rate
    if not spans and host_rate(spec, price, spot) is None:
        usd = rate_total = None
    first = min((s.start for s in spans), default=now)
    last = max((s.end if s.end is not None else now for s in spans), default=now)
    return JobCost(
        accelerator=spec.name,
        spot=spot,
        hosts=len(spans),
        minutes=max(0.0, last - first) / 60.0,
        host_minutes=sum(s.seconds(now) for s in spans) / 60.0,
        usd_per_hour=rate_total,
        usd=usd,
        price_source=(price.source if price is not None else "no price for this accelerator"),
        ended=bool(spans) and all(s.end is not None for s in spans),
    )


def seconds_to_budget(
    spec: accelerators.AcceleratorSpec, spans: list[HostSpan], price: Price | None, budget: float, now: float
) -> float | None:
    """How long the running hosts can go on before the job's cost reaches ``budget`` (0: reached)."""
    current = job_cost(spec, spans, price, now)
    if current.usd is None or not current.usd_per_hour:
        return None
    running_rate = sum(host_rate(spec, price, s.spot) or 0.0 for s in spans if s.end is None)
    if current.usd >= budget:
        return 0.0
    return math.inf if running_rate <= 0 else (budget - current.usd) / running_rate * 3600.0


def budget_message(budget: float, minutes: float) -> str:
    """The run's final message when its budget stopped it (in seconds under a minute: never "after 0.0 min")."""
    took = f"{minutes * 60:.1f} s" if minutes < 1 else f"{minutes:.1f} min"
    return f"budget of ${budget:g} reached after {took}"


@dataclass
class FlowCost:
    """The running total of a flow run's kinetic calls."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total_usd(self) -> float:
        return sum(row.get("usd") or 0.0 for row in self.rows)

    @property
    def unpriced(self) -> int:
        return sum(row.get("usd") is None for row in self.rows)

    def as_dict(self) -> dict[str, Any]:
        return {
            "total_usd": round(self.total_usd, 6),
            "calls": len(self.rows),
            "unpriced_calls": self.unpriced,
            "rows": self.rows,
        }


__all__ = [
    "FlowCost",
    "HostSpan",
    "JobCost",
    "PriceTableError",
    "budget_message",
    "check_budget",
    "job_cost",
    "load_prices",
    "price_for",
    "TABLES",
]
