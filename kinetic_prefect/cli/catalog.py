"""``kinetic-prefect catalog`` and ``accelerators``: the accelerator catalog, as a table or in the README."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import typer
from rich.table import Table

from kinetic_prefect import accelerators
from kinetic_prefect.cli.console import make_console

CATALOG_START, CATALOG_END = "<!-- catalog:start -->", "<!-- catalog:end -->"


def readme_with_catalog(text: str) -> str:
    """The README text with the generated catalog table between its markers."""
    pattern = re.compile(re.escape(CATALOG_START) + r".*?" + re.escape(CATALOG_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"the README has no {CATALOG_START} ... {CATALOG_END} section")
    block = f"{CATALOG_START}\n{accelerators.markdown_table().rstrip()}\n{CATALOG_END}"
    return pattern.sub(lambda _: block, text)


def catalog_command(
    write_readme: Path | None = typer.Option(
        None, "--write-readme", metavar="README", help="rewrite the catalog section of this file"
    ),
) -> None:
    """Print the accelerator catalog as a Markdown table (or write it into the README)."""
    if write_readme:
        write_readme.write_text(readme_with_catalog(write_readme.read_text()))
    else:
        sys.stdout.write(accelerators.markdown_table())


def accelerators_command(
    family: str | None = typer.Option(None, "--family", metavar="FAMILY", help="only this family: cpu, gpu or tpu"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """List the accelerator names @kinetic_task(accelerator=...) accepts, with what GKE runs them on."""
    specs = [s for s in accelerators.catalog() if family is None or s.family == family]
    if family is not None and not specs:
        raise typer.BadParameter(f"{family!r}: choose cpu, gpu or tpu", param_hint="--family")
    if as_json:
        rows = [
            {
                "name": s.name,
                "family": s.family,
                "chips": s.chips,
                "hosts": s.hosts,
                "chips_per_host": s.chips_per_host,
                "gke_accelerator": s.gke_accelerator,
                "tpu_topology": s.tpu_topology,
                "machine_type": s.machine_type,
                "node_selector": s.node_selector,
            }
            for s in specs
        ]
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    table = Table(title="kinetic accelerator catalog (any name also takes :spot)")
    for column in ("name", "family", "chips", "hosts x chips/host", "GKE accelerator", "TPU topology", "machine type"):
        table.add_column(column, justify="right" if column == "chips" else "left", no_wrap=True)
    for s in specs:
        table.add_row(
            s.name,
            s.family,
            str(s.chips),
            f"{s.hosts} x {s.chips_per_host}",
            s.gke_accelerator or "-",
            s.tpu_topology or "-",
            s.machine_type,
        )
    console = make_console()
    console.width = max(console.width, 120)
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add ``catalog`` and ``accelerators`` to the ``kinetic-prefect`` app."""
    app.command("catalog")(catalog_command)
    app.command("accelerators")(accelerators_command)
