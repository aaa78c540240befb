"""A launcher's own ``kinetic-prefect`` commands come from its registration line (``workers.LAUNCHERS``' ``commands``
module), so ``cli/`` holds no launcher's code: kinetic-gke's ``gke-worker-image`` and ``gke-worker-manifests`` live in
``workers/gke/commands.py``, and a new launcher adds its commands without an edit to ``cli/``."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import typer
from typer.testing import CliRunner

from kinetic_prefect import workers
from kinetic_prefect.cli import main

pytestmark = pytest.mark.no_server
cli_app = importlib.import_module("kinetic_prefect.cli.app")  # the module (the package's `app` is the Typer app)


def _names(app: typer.Typer) -> list[str]:
    return [command.name for command in app.registered_commands]


def test_a_launchers_commands_are_added_from_its_registration_line(monkeypatch):
    fake = types.ModuleType("fake_launcher_commands")

    def register(app: typer.Typer) -> None:
        @app.command("fake-hello")
        def hello() -> None:
            """Say hello from the fake launcher."""
            print("hello from the fake launcher")

    fake.register = register  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(
        workers,
        "LAUNCHERS",
        {
            "kinetic-fake": workers.Launcher("x:FakeWorker", (), fake.__name__),
            "kinetic-plain": workers.Launcher("x:Plain", ()),  # a launcher with no commands of its own
        },
    )
    app = typer.Typer()
    app.command("other")(lambda: None)
    cli_app._launcher_commands(app)
    assert _names(app) == ["other", "fake-hello"]
    result = CliRunner().invoke(app, ["fake-hello"])
    assert result.exit_code == 0 and "hello from the fake launcher" in result.output


def test_kinetic_gkes_commands_come_from_its_folder_with_their_help(capsys):
    from kinetic_prefect.workers.gke import commands

    app = typer.Typer()
    commands.register(app)
    assert _names(app) == ["gke-worker-image", "gke-worker-manifests"]
    assert main(["gke-worker-manifests", "--help"]) == 0
    assert "Print manifests that run a kinetic-gke worker in a cluster" in capsys.readouterr().out
    assert main(["gke-worker-image", "--help"]) == 0
    assert "Build the in-cluster kinetic-gke worker image" in capsys.readouterr().out
