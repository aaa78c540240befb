"""Worker side: the pool templates (``work_pools/<type>.json``) generated from the typed models.

``variables``: the worker class's variables model (``job_configuration_variables``: ``workers/<launcher>/variables.py``)
as pydantic's JSON schema, which is what Prefect's UI renders as the pool's form. ``job_configuration``: a placeholder
for each field of the worker's job configuration, plus, where the worker class has one (``kinetic-gke``), the manifest
its jobs start from (``job_manifest_template``). Every type of ``contract.WORKER_TYPES`` is written.

    python -m kinetic_prefect.workers.templates          # rewrite work_pools/*.json
    python -m kinetic_prefect.workers.templates --check  # exit 1 if a committed file differs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kinetic_prefect import config
from kinetic_prefect.contract import WORKER_TYPES
from kinetic_prefect.workers.base import kinetic_worker_class


def generated_template(worker_type: str) -> dict[str, Any]:
    """The base job template of ``worker_type``, from its worker class's job configuration and variables models (and
    the manifest a launcher starts its jobs from, where its class has one: ``job_manifest_template``)."""
    worker_class = kinetic_worker_class(worker_type)
    configuration = worker_class.job_configuration
    variables = worker_class.job_configuration_variables
    manifest_of = getattr(worker_class, "job_manifest_template", None)
    manifest = manifest_of() if manifest_of is not None else None
    job_configuration = configuration.json_template()
    if manifest is not None:
        job_configuration["job_manifest"] = manifest
    schema = variables.model_json_schema()
    schema.pop("title", None)
    schema.pop("description", None)
    for prop in schema.get("properties", {}).values():
        _as_the_ui_reads_it(prop)
    return {"job_configuration": job_configuration, "variables": schema}


def _as_the_ui_reads_it(prop: dict[str, Any]) -> None:
    """Optional variables as both Prefect UIs render them (docs/ui.md): one type, not ``anyOf`` with null (the
    V2 form opens a "None" tab, the default UI renders no form at all), and no null default, so an unset
    variable is absent from the job configuration and the configuration field's own default applies."""
    options = prop.get("anyOf")
    if options is not None:
        kept = [option for option in options if option != {"type": "null"}]
        if len(kept) == 1:
            del prop["anyOf"]
            prop.update(kept[0])
        else:
            prop["anyOf"] = kept
    if "default" in prop and prop["default"] is None:
        del prop["default"]


def template_text(worker_type: str) -> str:
    return json.dumps(generated_template(worker_type), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    stale = []
    for worker_type in WORKER_TYPES:
        path: Path = config.work_pools_dir() / f"{worker_type}.json"
        text = template_text(worker_type)
        if path.exists() and path.read_text() == text:
            continue
        if check:
            stale.append(str(path))
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("out of date (run `python -m kinetic_prefect.workers.templates`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
