"""Worker side: the job's usage samples (``kinetic_prefect.pod.utilization`` lines) as artifacts on the job's run.

``wrap`` takes the sample lines out of the forwarded output (they are data, not log lines); ``publish`` (when
the run is final) makes a table artifact (peak and mean of each figure) and a markdown artifact with the plot
over time (an SVG drawn here, inline as a data URL, so no plotting library is needed on the worker), and logs a
one-line hint when the accelerator was mostly idle or its memory mostly unused.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

from prefect.client.schemas.objects import FlowRun

from kinetic_prefect import accelerators
from kinetic_prefect.contract import USAGE_ARTIFACT_KEY, USAGE_PLOT_ARTIFACT_KEY
from kinetic_prefect.pod.utilization import parse

GIB = 2**30
# Memory of one GPU / one TPU chip (GiB), from the vendors' public specifications, for the hints.
ACCELERATOR_MEMORY_GIB = {
    "nvidia-tesla-t4": 16,
    "nvidia-tesla-p4": 8,
    "nvidia-tesla-p100": 16,
    "nvidia-tesla-v100": 16,
    "nvidia-l4": 24,
    "nvidia-tesla-a100": 40,
    "nvidia-a100-80gb": 80,
    "nvidia-h100-80gb": 80,
    "nvidia-h100-mega-80gb": 80,
    "nvidia-h200-141gb": 141,
    "nvidia-b200": 180,
    "nvidia-gb200": 186,
    "nvidia-rtx-pro-6000": 96,
    "tpu-v4-podslice": 32,
    "tpu-v5-lite-podslice": 16,
    "tpu-v5p-slice": 95,
    "tpu-v6e-slice": 32,
    "tpu7x": 192,
}
# Smaller single GPUs a job could move to, smallest first (catalog names).
GPU_LADDER = ("l4", "a100", "a100-80gb", "h200")
IDLE_PERCENT = 30.0
UNUSED_MEMORY_PERCENT = 25.0


def memory_gib(spec: accelerators.AcceleratorSpec) -> float | None:
    return ACCELERATOR_MEMORY_GIB.get(spec.gke_accelerator or "")


def summarize(samples: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Peak and mean of each figure over the samples: {name: {"peak": p, "mean": m, "unit": u}}."""
    series: dict[str, list[float]] = {}

    def add(name: str, value: Any) -> None:
        if isinstance(value, (int, float)):
            series.setdefault(name, []).append(float(value))

    for sample in samples:
        add("host CPU (% of cores)", sample.get("cpu"))
        if sample.get("rss") is not None:
            add("host memory (GiB)", sample["rss"] / GIB)
        gpus = sample.get("gpus") or []
        utils = [g["util"] for g in gpus if "util" in g]
        if utils:
            add("GPU utilization (%)", sum(utils) / len(utils))
        used = [g["mem_used"] for g in gpus if "mem_used" in g]
        if used:
            add("GPU memory, NVML (GiB, busiest GPU)", max(used) / GIB)
            totals = [g["mem_total"] for g in gpus if g.get("mem_total")]
            if totals:
                add("GPU memory, NVML (% of one GPU)", 100.0 * max(used) / max(totals))
        devices = sample.get("devices") or []
        if devices:
            add("accelerator memory in use, JAX (GiB, busiest device)", max(d["in_use"] for d in devices) / GIB)
            add("accelerator memory peak, JAX (GiB, busiest device)", max(d["peak"] for d in devices) / GIB)
            limits = [d for d in devices if d.get("limit")]
            if limits:
                add("accelerator memory peak, JAX (% of limit)", max(100.0 * d["peak"] / d["limit"] for d in limits))
    return {
        name: {"peak": round(max(values), 3), "mean": round(sum(values) / len(values), 3), "samples": len(values)}
        for name, values in series.items()
    }


def hint(spec: accelerators.AcceleratorSpec, summary: dict[str, dict[str, float]]) -> str | None:
    """One line when the accelerator was mostly idle or its memory mostly unused (None: nothing to say)."""
    if spec.family == "cpu":
        return None
    gpu_seen = "GPU utilization (%)" in summary or any(k.startswith("accelerator memory") for k in summary)
    if not gpu_seen:
        return (
            f"the job asked for {spec.name} but saw no accelerator (no NVML GPU, no JAX device memory): its work used "
            "the CPU, or never initialised JAX on the device"
        )
    total = memory_gib(spec)
    peak_gib = (
        summary.get("accelerator memory peak, JAX (GiB, busiest device)")
        or summary.get("GPU memory, NVML (GiB, busiest GPU)")
        or {}
    ).get("peak")
    if total and peak_gib is not None:
        share = 100.0 * peak_gib / total
        if share < UNUSED_MEMORY_PERCENT:
            word = "HBM" if spec.family == "tpu" else "GPU memory"
            smaller = next(
                (
                    name
                    for name in GPU_LADDER
                    if spec.family == "gpu"
                    and name != spec.name
                    and (memory_gib(accelerators.resolve(name)) or 0) >= peak_gib * 1.25
                    and (memory_gib(accelerators.resolve(name)) or 0) < total
                ),
                None,
            )
            tail = f": an {smaller} would do" if smaller else ": a smaller accelerator would do"
            return f"peak {word} {share:.0f} % of a{'n' if spec.name[0] in 'aeiou' else ''} {spec.name}{tail}"
    util = summary.get("GPU utilization (%)")
    if util and util["mean"] < IDLE_PERCENT:
        return (
            f"the GPU was busy {util['mean']:.0f} % of the time on average (peak {util['peak']:.0f} %): the job "
            "waits on input or the CPU; feed it faster or use a smaller GPU"
        )
    return None


def plot_svg(samples: list[dict[str, Any]], width: int = 720, height: int = 260) -> str:
    """Percent figures over time as one SVG line chart: CPU, host memory (of the machine), GPU, accelerator memory."""
    if not samples:
        return ""
    start = samples[0]["t"]
    span = max(1e-6, samples[-1]["t"] - start)
    lines: dict[str, tuple[str, list[tuple[float, float]]]] = {
        "host CPU %": ("#1f77b4", []),
        "host memory % of machine": ("#2ca02c", []),
        "GPU utilization %": ("#d62728", []),
        "accelerator memory % of limit": ("#9467bd", []),
    }
    for sample in samples:
        x = sample["t"] - start
        if isinstance(sample.get("cpu"), (int, float)):
            lines["host CPU %"][1].append((x, sample["cpu"]))
        if sample.get("rss") and sample.get("mem_total"):
            lines["host memory % of machine"][1].append((x, 100.0 * sample["rss"] / sample["mem_total"]))
        utils = [g["util"] for g in sample.get("gpus") or [] if "util" in g]
        if utils:
            lines["GPU utilization %"][1].append((x, sum(utils) / len(utils)))
        limited = [d for d in sample.get("devices") or [] if d.get("limit")]
        if limited:
            share = max(100.0 * d["in_use"] / d["limit"] for d in limited)
            lines["accelerator memory % of limit"][1].append((x, share))
    left, right, top, bottom = 48, 16, 16, 56
    plot_w, plot_h = width - left - right, height - top - bottom

    def point(x: float, y: float) -> str:
        return f"{left + plot_w * x / span:.1f},{top + plot_h * (1 - min(100.0, max(0.0, y)) / 100.0):.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        f'font-size="11"><rect width="{width}" height="{height}" fill="white"/>'
    ]
    for pct in (0, 25, 50, 75, 100):
        y = top + plot_h * (1 - pct / 100)
        parts.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{pct}%</text>'
        )
    parts.append(
        f'<text x="{left + plot_w / 2}" y="{top + plot_h + 18}" text-anchor="middle">'
        f"seconds since the first sample (0 – {span:.0f} s)</text>"
    )
    legend_x = left
    for label, (color, points) in lines.items():
        if not points:
            continue
        parts.append(
            f'<polyline fill="none" stroke="{color}" stroke-width="1.8" '
            f'points="{" ".join(point(x, y) for x, y in points)}"/>'
        )
        parts.append(
            f'<rect x="{legend_x}" y="{height - 18}" width="10" height="10" fill="{color}"/>'
            f'<text x="{legend_x + 14}" y="{height - 9}">{label}</text>'
        )
        legend_x += 14 + 7 * len(label) + 18
    parts.append("</svg>")
    return "".join(parts)


class UsageReport:
    """Collects the job's usage samples as its output is forwarded; publishes them once the run is final."""

    MAX_SAMPLES = 5000  # a week at one sample every 2 minutes, or almost 3 hours at the default 2 s

    def __init__(
        self,
        client: Any,
        flow_run: FlowRun,
        spec: accelerators.AcceleratorSpec,
        asked: accelerators.AcceleratorSpec | None = None,
    ):
        self.client, self.flow_run, self.spec = client, flow_run, spec
        self.asked = asked or spec  # what the call asked for: the hint compares what the job saw with it
        self.samples: list[dict[str, Any]] = []

    def wrap(self, emit: Callable[[str], None]) -> Callable[[str], None]:
        def filtered(text: str) -> None:
            kept = []
            for line in text.split("\n"):
                sample = parse(line)
                if sample is None:
                    kept.append(line)
                elif len(self.samples) < self.MAX_SAMPLES:
                    self.samples.append(sample)
                else:  # keep the whole run's shape: thin the series instead of cutting its end
                    self.samples = self.samples[::2] + [sample]
            if kept:
                emit("\n".join(kept))

        return filtered

    async def publish(self, logger: Any) -> None:
        if not self.samples:
            return
        from prefect.client.schemas.actions import ArtifactCreate

        summary = summarize(self.samples)
        advice = hint(self.asked, summary)
        rows = [
            {"figure": name, "peak": v["peak"], "mean": v["mean"], "samples": v["samples"]}
            for name, v in summary.items()
        ]
        seconds = self.samples[-1]["t"] - self.samples[0]["t"]
        description = (
            f"Usage of kinetic job {self.flow_run.name} on {self.spec.name}: "
            f"{len(self.samples)} samples over {seconds:.0f} s"
        )
        svg = plot_svg(self.samples)
        markdown = (
            f"## Usage of {self.flow_run.name} ({self.spec.name})\n\n"
            + (f"**Hint:** {advice}\n\n" if advice else "")
            + f"![usage over time](data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode()})\n\n"
            + "| figure | peak | mean |\n| --- | ---: | ---: |\n"
            + "".join(f"| {r['figure']} | {r['peak']:g} | {r['mean']:g} |\n" for r in rows)
        )
        try:
            await self.client.create_artifact(
                ArtifactCreate(
                    key=USAGE_ARTIFACT_KEY,
                    type="table",
                    data=json.dumps(rows),
                    flow_run_id=self.flow_run.id,
                    description=description + (f". Hint: {advice}" if advice else ""),
                )
            )
            await self.client.create_artifact(
                ArtifactCreate(
                    key=USAGE_PLOT_ARTIFACT_KEY,
                    type="markdown",
                    data=markdown,
                    flow_run_id=self.flow_run.id,
                    description=description + " (plot)",
                )
            )
        except Exception as exc:  # a report: it never fails the job
            logger.warning(f"Could not record the job's usage artifacts ({type(exc).__name__}: {exc})")
            return
        if advice:
            logger.info(f"Usage hint: {advice}")


__all__ = ["UsageReport", "hint", "plot_svg", "summarize"]
