"""MkDocs hook: the parts of the site generated from the repository, so no figure or option is copied by hand.

A page asks for one with a marker line:

- ``<!-- generated:bench-results -->``: every ``bench/results/*.json``, each as a folded table of its recorded
  figures (nested records flattened to dotted keys: a result's history is in its file, so it is here too);
  the plots in ``bench/results/*.png`` are published under ``bench-results/``.
- ``<!-- generated:pool-variables WORKER_TYPE -->``: the variables of ``work_pools/WORKER_TYPE.json`` (the form a
  pool shows in the UI): name, type, default, description.
- ``<!-- generated:cli-help -->``: ``kinetic-prefect --help`` and each command's ``--help``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PLOTS_URI = "bench-results"
MARKER = re.compile(r"^<!-- generated:(?P<what>[a-z-]+)(?: (?P<arg>[\w.-]+))? -->$", re.M)
MAX_ROWS = 60  # per results file: past it the file itself is the place to look
SKIPPED_KEYS = {"history", "curve", "epoch_seconds", "ms_per_step_by_epoch"}  # per-epoch series, in the file


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for plot in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"{PLOTS_URI}/{plot.name}", abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    def render(match: re.Match[str]) -> str:
        what, arg = match["what"], match["arg"]
        if what == "bench-results":
            return bench_results()
        if what == "pool-variables" and arg:
            return pool_variables(arg)
        if what == "cli-help":
            return cli_help()
        raise ValueError(f"{page.file.src_uri}: unknown marker {match[0]!r} (see docs/hooks/generated.py)")

    return MARKER.sub(render, markdown)


# ------------------------------------------------------------------------------------------ bench/results


def _cell(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, (list, tuple)):
        text = ", ".join(_cell(v) for v in value)
    else:
        text = str(value)
    text = " ".join(text.split())
    return text.replace("|", "\\|")


def _flatten(record: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Scalars (and short lists of scalars) of a nested record, under dotted keys."""
    rows: list[tuple[str, Any]] = []
    if isinstance(record, dict):
        for key, value in record.items():
            if key in SKIPPED_KEYS:
                continue
            rows.extend(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(record, list):
        if len(record) <= 8 and all(not isinstance(v, (dict, list)) for v in record):
            rows.append((prefix, record))
        else:
            for index, value in enumerate(record[:8]):
                rows.extend(_flatten(value, f"{prefix}[{index}]"))
            if len(record) > 8:
                rows.append((prefix, f"... {len(record) - 8} more entries in the file"))
    elif record is not None:
        rows.append((prefix, record))
    return rows


def _summary(data: Any) -> str:
    if isinstance(data, dict):
        for key in ("what", "benchmark", "note", "command"):
            if isinstance(data.get(key), str):
                return " ".join(data[key].split())[:160]
    return ""


def bench_results() -> str:
    parts = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        rows = _flatten(data)
        shown = rows[:MAX_ROWS]
        summary = _summary(data)
        title = f"`{path.name}`" + (f": {summary}" if summary else "")
        table = ["| key | value |", "| --- | --- |"] + [f"| `{key}` | {_cell(value)} |" for key, value in shown]
        if len(rows) > MAX_ROWS:
            table.append(f"| ... | {len(rows) - MAX_ROWS} more values in `bench/results/{path.name}` |")
        parts.append(f'??? note "{title.replace(chr(34), chr(39))}"\n\n' + "\n".join("    " + line for line in table))
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------ pool variables


def _schema_type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return "block: " + prop["$ref"].rsplit("/", 1)[-1]
    kind = str(prop.get("type", "any"))
    if "enum" in prop:
        kind += " (" + ", ".join(f"`{v}`" for v in prop["enum"]) + ")"
    if prop.get("type") == "array" and isinstance(prop.get("items"), dict):
        kind += " of " + str(prop["items"].get("type", "any"))
    return kind


def pool_variables(worker_type: str) -> str:
    template = json.loads((ROOT / "work_pools" / f"{worker_type}.json").read_text())
    lines = ["| variable | type | default | what |", "| --- | --- | --- | --- |"]
    for name, prop in template["variables"]["properties"].items():
        default = f"`{json.dumps(prop['default'])}`" if "default" in prop else "unset"
        lines.append(f"| `{name}` | {_schema_type(prop)} | {default} | {_cell(prop.get('description', ''))} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ the CLI


def cli_help() -> str:
    """Each command's help as the terminal shows it (typer renders it with rich, so it is captured)."""
    import click
    import typer.main
    from typer.testing import CliRunner

    # The CLI imports prefect-kubernetes (at import, or when a command's help is rendered: some commands import
    # it lazily), whose flows' docstrings Prefect parses with griffe: their warnings would reach this build
    # through mkdocstrings' logger, and they are not this site's.
    # A filter on both loggers: setting ``disabled`` on them did not keep these records out of the build.
    griffe_logs = [logging.getLogger(name) for name in ("mkdocs.plugins.griffe", "griffe")]  # mkdocstrings', griffe's
    drop_all = logging.Filter("\0nothing matches")
    for log in griffe_logs:
        log.addFilter(drop_all)
    try:
        from kinetic_prefect.cli import app

        runner = CliRunner()
        env = {"COLUMNS": "110", "NO_COLOR": "1", "TERM": "dumb"}
        command = typer.main.get_command(app)
        with click.Context(command, info_name="kinetic-prefect") as context:
            names = list(command.list_commands(context))  # type: ignore[attr-defined]
        parts = []
        for args in [[], *([name] for name in names)]:
            result = runner.invoke(app, [*args, "--help"], env=env, prog_name="kinetic-prefect")
            if result.exit_code != 0:
                raise RuntimeError(f"kinetic-prefect {' '.join(args)} --help failed: {result.output}")
            parts.append((" ".join(["kinetic-prefect", *args]), result.output.rstrip()))
    finally:
        for log in griffe_logs:
            log.removeFilter(drop_all)
    return "\n\n".join(f"## `{title}`\n\n```text\n{text}\n```" for title, text in parts) + "\n"
