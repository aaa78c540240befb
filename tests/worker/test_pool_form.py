"""The work pools' forms: the shipped base job templates render as form fields in both Prefect UIs.

Prefect's two UIs build a pool's "Base Job Template" form from ``variables`` (a JSON schema). The default
(V1) UI renders nothing at all when a property's ``type`` is a list (``["string", "null"]``); the V2 UI
renders a nullable property (``type`` list or ``anyOf`` with ``{"type": "null"}``) as two tabs, and with a
``null`` default opens the "None" tab, which reads `Property is type "None"`. So the templates hold an
optional field as one plain type with no default: unset means absent, and the job configuration's own
default (None) applies. The browser tests open the edit page of a ``kinetic-gke`` and a ``kinetic-local``
pool in both UIs (headless Chromium; skipped without it unless CI is set).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ui_check

from kinetic_prefect.workers.base import load_template

WORKER_TYPES = ("kinetic-gke", "kinetic-local")
NONE_MESSAGE = ui_check.NONE_MESSAGE


def _variables(worker_type: str) -> dict:
    return load_template(worker_type)["variables"]


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_every_variable_has_one_type_and_no_null_default(worker_type):
    """The schema facts both UIs need (a generator of the templates must keep them)."""
    problems = []
    for name, prop in _variables(worker_type)["properties"].items():
        if isinstance(prop.get("type"), list):
            problems.append(f"{name}: type is a list {prop['type']} (the default UI renders no form at all)")
        if any(option == {"type": "null"} for option in prop.get("anyOf", [])):
            problems.append(f"{name}: anyOf with null (the V2 UI shows {NONE_MESSAGE})")
        if "default" in prop and prop["default"] is None:
            problems.append(f"{name}: default null (leave the default out: unset means absent)")
        if "type" not in prop and "$ref" not in prop and "enum" not in prop:
            problems.append(f"{name}: neither a type nor a $ref")
        if not prop.get("title"):
            problems.append(f"{name}: no title (the form's label)")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_unset_variables_leave_the_configuration_defaults(worker_type):
    """A variable left unset is absent from the rendered configuration, so the field's default (None) applies,
    and a value set as a job variable still arrives."""
    import asyncio

    if worker_type == "kinetic-gke":
        from kinetic_prefect.workers.gke.configuration import KineticGKEJobConfiguration as Configuration
    else:
        from kinetic_prefect.workers.local.configuration import KineticLocalJobConfiguration as Configuration
    template = load_template(worker_type)
    fields = Configuration.model_fields
    unset = [
        name for name, prop in template["variables"]["properties"].items() if "default" not in prop and name in fields
    ]
    assert len(unset) >= 5, f"expected the optional variables to be unset by default, got {unset}"
    config = asyncio.run(Configuration.from_template_and_values(template, {}))
    assert {name: getattr(config, name) for name in unset} == {
        name: fields[name].get_default(call_default_factory=True) for name in unset
    }
    assert {getattr(config, name) for name in unset if name not in ("annotations",)} == {None}
    config = asyncio.run(Configuration.from_template_and_values(template, {"hosts": 2, "store": "/tmp/s"}))
    assert (config.hosts, config.store) == (2, "/tmp/s")


# ------------------------------------------------------------------------------------------ in a browser


@pytest.fixture(scope="module")
def browser():
    path = ui_check.find_chromium()
    if not path:
        message = "chromium is not installed (Debian: apt-get install -y chromium); the form checks need a browser"
        if os.environ.get("CI"):
            pytest.fail(message + " and CI is set")
        pytest.skip(message)
    browser = ui_check.Browser(path)
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def pools(prefect_server):
    """One pool of each kinetic type, created from the shipped templates."""
    names = {}
    for worker_type in WORKER_TYPES:
        name = f"form-{worker_type}"
        body = {"name": name, "type": worker_type, "base_job_template": load_template(worker_type)}
        try:
            ui_check.post_json(f"{prefect_server}/work_pools/", body)
        except OSError as exc:  # 409: made by an earlier run of this module against the same server
            if getattr(exc, "code", None) != 409:
                raise
        names[worker_type] = name
    return names


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ui", ["v1", "v2"])
@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_pool_edit_page_shows_the_form(browser, pools, prefect_server, worker_type, ui):
    out = os.environ.get("KINETIC_UI_SCREENSHOTS")
    shot = Path(out) / f"pool-form-{worker_type}-{ui}.png" if out else None
    ui_check.check_pool_form(
        browser,
        prefect_server.removesuffix("/api"),
        pools[worker_type],
        worker_type,
        load_template(worker_type),
        ui,
        shot,
    )
