"""What the ``kinetic-prefect`` commands share: a console made per call, and click's exception type."""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.console import Console

# Typer 0.29 carries its own copy of click; its ClickException is the base of typer.BadParameter.
ClickException: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def make_console() -> Console:
    """Made per call (not at import), so it writes to whatever sys.stdout is now (pytest's capsys, pipes)."""
    return Console(file=sys.stdout, soft_wrap=True, highlight=False)
