"""The README a newcomer reads, and what the documentation site takes from it.

The site itself is built with `mkdocs build --strict` by .ci/run (a broken link, a missing page or an API name
the docstrings lost fails it); these checks are the README's own promises.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_server

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 250


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move details into a page under docs/"
    )


def test_readme_starts_with_the_two_commands():
    """The first command is the one bench/bench_eurosat.py times (its figures are quoted under it)."""
    text = README.read_text()
    block = re.search(r"```bash\n(.*?)\n```", text, re.S)
    assert block, "README.md has no bash block"
    commands = block.group(1).splitlines()
    timed = json.loads((ROOT / "bench" / "results" / "eurosat_first_command.json").read_text())["command"]
    assert commands == [timed, "uv run --all-extras pytest"], commands
    assert text.index(block.group(0)) < text.index("\n## "), "the two commands must come before any section"


def test_the_sections_the_site_includes_are_marked_in_the_readme():
    """docs/what-happens-when.md and docs/verification.md include these README sections (pymdownx.snippets)."""
    text = README.read_text()
    for section, page in (("what-happens-when", "what-happens-when.md"), ("verification", "verification.md")):
        start, end = f"<!-- --8<-- [start:{section}] -->", f"<!-- --8<-- [end:{section}] -->"
        assert text.count(start) == 1 and text.count(end) == 1 and text.index(start) < text.index(end), section
        assert f'--8<-- "README.md:{section}"' in (ROOT / "docs" / page).read_text(), page
    rows = text[text.index("<!-- --8<-- [start:what-happens-when] -->") :].split("<!-- --8<-- [end:")[0]
    assert "| you... | the job | the job's run | the task run |" in rows
