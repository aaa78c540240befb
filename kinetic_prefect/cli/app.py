"""``kinetic-prefect``: helper commands (the work itself goes through Prefect's own CLI).

    kinetic-prefect doctor [--pool NAME] [--accelerator NAME ...] [--store URL] [--deployments] [--gke-cluster PATH]
                           [--json]
    kinetic-prefect accelerators [--family gpu|tpu|cpu] [--json]
    kinetic-prefect catalog [--write-readme README.md]
    kinetic-prefect pool-set POOL KEY=VALUE ...
    kinetic-prefect gke-worker-image --repository REPOSITORY [--push] [--base-image IMAGE]
    kinetic-prefect gke-worker-manifests --pool NAME (--image IMAGE | --repository REPOSITORY) [--namespace NS]
    kinetic-prefect up | down | pool add|remove|list   (cli.provision: GKE from zero)
    kinetic-prefect jobs list | status | logs [-f] | result | cancel | cleanup   (cli.jobs)
    kinetic-prefect warm list | down   (cli.warm)
    kinetic-prefect cleanup [--store DIR] [--older-than MINUTES] [--uncollected-older-than MINUTES] [--yes]
    kinetic-prefect cost [--flow-run ID ...] [--deployment FLOW/NAME] [--flow NAME] [--since DATE] [--until DATE]
                         [--last N] [--json]
    kinetic-prefect cost --estimate TASK_OR_ACCELERATORS --minutes N [--hosts N] [--json]

The root only composes: each command group is a module of ``cli/`` that adds its commands (``register(app)``)
or its sub-app; a launcher's own commands come from its registration line (``workers.LAUNCHERS``). Typer + rich, like
Prefect's own CLI. ``main(argv)`` returns the exit status instead of exiting, so scripts and tests can call it
in-process.
"""

from __future__ import annotations

import sys

import typer

from kinetic_prefect.cli import catalog, checks, cleanup, cost, provision
from kinetic_prefect.cli.catalog import readme_with_catalog
from kinetic_prefect.cli.console import ClickException
from kinetic_prefect.cli.jobs import jobs_app
from kinetic_prefect.cli.warm import warm_app

app = typer.Typer(
    name="kinetic-prefect",
    help="Helper commands for kinetic-prefect.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _launcher_commands(app: typer.Typer) -> None:
    """The commands of each launcher that has its own (the ``register`` of its ``commands`` module, e.g. kinetic-gke's
    ``gke-worker-image`` and ``gke-worker-manifests``): the CLI holds no launcher's code, and the modules are light,
    so ``--help`` imports no launcher."""
    from kinetic_prefect import workers

    for module in workers.commands_modules():
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


# In the order `kinetic-prefect --help` lists them.
catalog.register(app)  # catalog, accelerators
checks.register(app)  # doctor, pool-set
_launcher_commands(app)  # e.g. gke-worker-image, gke-worker-manifests
cleanup.register(app)
cost.register(app)
app.add_typer(jobs_app)
provision.register(app)  # up, down, pool add|remove|list
app.add_typer(warm_app)


def main(argv: list[str] | None = None) -> int:
    """Run a command; returns its exit status (usage errors print their message and return 2)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        result = typer.main.get_command(app).main(args=args, prog_name="kinetic-prefect", standalone_mode=False)
    except typer.Exit as exc:
        return exc.exit_code
    except ClickException as exc:
        exc.show()
        return exc.exit_code
    except typer.Abort:
        sys.stderr.write("Aborted.\n")
        return 1
    return result if isinstance(result, int) else 0


__all__ = ["app", "main", "readme_with_catalog"]
