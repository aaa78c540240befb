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


DOC_PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = ("bash", "sh", "shell", "console", "")
# In a uv checkout these exit 127 (or install into another Python) unless run through `uv run`.
BARE = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(kinetic-prefect|prefect|pytest|python3?|pip install)\b(.*)")


def _fenced_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every shell command in the page's fenced shell blocks, continuation lines left out."""
    out, language, continued = [], None, False
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"\s*```(\S*)", line)
        if fence:
            language = fence.group(1) if language is None else None
            continued = False
            continue
        if language in SHELL_BLOCKS:
            if not continued:
                out.append((number, line.strip()))
            continued = line.rstrip().endswith(("\\", "|"))
    return out


def _code_text(text: str) -> list[str]:
    """What a reader copies: the lines of fenced blocks and every inline code span."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    prose = re.sub(r"```[^\n]*\n.*?```", "", text, flags=re.S)
    return [line for block in blocks for line in block.splitlines()] + re.findall(r"`([^`\n]+)`", prose)


def test_every_shell_command_on_a_page_runs_from_a_checkout():
    """A page's command blocks run as printed from a uv checkout: `uv run prefect ...`, not `prefect ...`."""
    bare = []
    for page in DOC_PAGES:
        for number, line in _fenced_lines(page.read_text()):
            found = BARE.match(line)
            if found and not (found.group(1) == "pip install" and found.group(2).split()[:1] in (["uv"], ["-e"])):
                bare.append(f"{page.relative_to(ROOT)}:{number}: {line}")
    assert not bare, "commands that do not run in a uv checkout (prefix `uv run`):\n" + "\n".join(bare)


def test_no_page_offers_to_pip_install_the_package_from_an_index():
    """kinetic-prefect is not on PyPI: `pip install 'kinetic-prefect[gcp]'` finds no package."""
    offending = [
        f"{page.relative_to(ROOT)}: {span}"
        for page in DOC_PAGES
        for span in _code_text(page.read_text())
        if re.search(r"pip install ['\"]?kinetic-prefect", span)
    ]
    assert not offending, offending


def _kinetic_commands() -> dict[tuple[str, ...], str]:
    """Each distinct `kinetic-prefect WORD [WORD]` the pages print, with one place it is printed."""
    found: dict[tuple[str, ...], str] = {}
    for page in DOC_PAGES:
        for span in _code_text(page.read_text()):
            for match in re.finditer(r"kinetic-prefect((?:\s+[a-z][a-z0-9-]*){1,2})", span):
                found.setdefault(tuple(match.group(1).split()), f"{page.relative_to(ROOT)}: {span.strip()}")
    return found


def test_every_kinetic_prefect_command_the_pages_print_exists(capsys):
    """`uv run kinetic-prefect <command> ...` on a page names a command the CLI has (a group's subcommand too)."""
    from kinetic_prefect.cli import main

    commands = _kinetic_commands()
    assert ("doctor",) in {words[:1] for words in commands}, "the pages print no kinetic-prefect command?"
    unknown = []
    for words, where in sorted(commands.items()):
        capsys.readouterr()
        if main([words[0], "--help"]) != 0:
            unknown.append(f"{' '.join(words[:1])!r} ({where})")
            continue
        is_group = "Commands" in capsys.readouterr().out
        if is_group and len(words) > 1 and main([*words[:2], "--help"]) != 0:
            unknown.append(f"{' '.join(words[:2])!r} ({where})")
    assert not unknown, "kinetic-prefect has no such command: " + "; ".join(unknown)


def test_every_repository_path_the_readme_cites_exists():
    """A path the README names (a test file, a page, a script) is in the checkout; `kinetic_prefect/_work_pools`
    is the wheel's copy of work_pools/ (pyproject's force-include), not a folder of the checkout."""
    in_the_wheel = set(re.findall(r'^"[^"]+" = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M))
    top = r"(?:\.ci|tests|docs|bench|flows|kinetic_prefect|work_pools|docker)"
    cited = set(re.findall(rf"(?<![\w./-]){top}/[\w./*<>-]*[\w*/]", README.read_text()))
    missing = [path for path in sorted(cited - in_the_wheel) if not list(ROOT.glob(path.split("::")[0]))]
    assert not missing, f"README.md cites paths the checkout lacks: {missing}"


def test_the_readme_test_command_is_the_one_ci_runs():
    """`.ci/run`'s main session is the README's command plus options that only shape its report, and `--reruns`,
    which the README names; the parallelism lives in pyproject's addopts, so both run on two xdist workers."""
    readme_command = "uv run --all-extras pytest"
    ci = (ROOT / ".ci" / "run").read_text()
    sessions = [line for line in ci.splitlines() if line.startswith(readme_command)]
    main_session = [line for line in sessions if "--prefect-database" not in line]
    assert len(main_session) == 1, sessions
    extra = re.sub(r"\s(-q|-raR|-ra|--durations=\d+|--reruns \d+)(?=\s|$)", "", main_session[0])
    assert extra == readme_command, f".ci/run runs {main_session[0]!r}: move what changes the run into addopts"
    if "--reruns" in main_session[0]:
        assert "--reruns 1" in README.read_text(), "the README must say that CI reruns a failed test once"
    addopts = re.search(r'^addopts = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert addopts and "-n 2" in addopts.group(1) and "--dist loadfile" in addopts.group(1), addopts


def test_gke_page_counts_the_control_plane_tests():
    """docs/gke.md says how many tests run against the control plane: the number in tests/gke/test_gke_cluster.py."""
    import ast

    module = ast.parse((ROOT / "tests" / "gke" / "test_gke_cluster.py").read_text())
    count = sum(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
        for node in module.body
    )
    said = re.search(r"test_gke_cluster\.py`[^.]*?\b(\d+) tests", (ROOT / "docs" / "gke.md").read_text())
    assert said, "docs/gke.md no longer says how many control-plane tests there are"
    assert int(said.group(1)) == count, f"docs/gke.md says {said.group(1)} control-plane tests; there are {count}"


def test_the_checkout_ships_no_secret_looking_source_without_a_word():
    """The README's first command in this checkout warns about no "secret-looking source files": the project's
    own test of that warning (a module named like a secret) is listed in .kineticignore, wherever it lives."""
    from kinetic_prefect.caller.project_archive import _select_project_files

    selection = _select_project_files(ROOT)
    assert selection.secret_code == [] and selection.secrets == [], (selection.secret_code, selection.secrets)


def test_the_predict_command_the_first_command_prints_runs_from_a_checkout():
    """The README's first command ends with a `predict:` line; run as printed, it needs the ml extra (numpy, keras)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("eurosat_vit_summary", ROOT / "flows" / "eurosat_vit.py")
    assert spec and spec.loader
    flow = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flow)
    result = {"metrics": {"accuracy": 0.9, "macro_f1": 0.9, "num_test": 10}, "model_path": "out/eurosat_vit.keras"}
    lines = flow.where_to_look(result, api_url=None).splitlines()
    predict = next(line for line in lines if line.startswith("predict:"))
    command = predict.removeprefix("predict:").split("(")[0].split()
    assert command == [
        *["uv", "run", "--extra", "ml", "python", "flows/eurosat_vit.py", "predict"],
        "out/eurosat_vit.keras",
        "FOLDER",
    ]
    assert all("`prefect " not in line and "`kinetic-prefect " not in line for line in lines), lines


def _page_commands(program: str) -> list[tuple[str, list[str]]]:
    """(where, argv after `uv run PROGRAM`) of each full command line of the pages' shell blocks: continuation lines
    and quotes spanning lines joined, comments dropped, a trailing pipe cut."""
    import shlex

    found = []
    for page in DOC_PAGES:
        text = page.read_text()
        for block in re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", text, re.S):
            pending = ""
            for line in block.replace("\\\n", " ").splitlines():
                pending = f"{pending}\n{line}" if pending else line
                try:
                    words = shlex.split(pending, comments=True)
                except ValueError:  # a quote that goes on on the next line
                    continue
                pending = ""
                if "|" in words:
                    words = words[: words.index("|")]
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                    words = words[1:]
                if words[:3] == ["uv", "run", program]:
                    found.append((f"{page.relative_to(ROOT)}: {line.strip()[:80]}", words[3:]))
    return found


def test_every_kinetic_prefect_command_line_on_a_page_parses():
    """Each `uv run kinetic-prefect ...` line of a page's shell blocks names options and arguments its command has,
    of the right types (the CLI parses it as a user's shell would pass it, without running it)."""
    import typer

    from kinetic_prefect.cli.app import app
    from kinetic_prefect.cli.console import ClickException

    lines = _page_commands("kinetic-prefect")
    assert len(lines) > 10, lines
    refused = []
    for where, argv in lines:
        command = typer.main.get_command(app)
        context = None
        try:
            while hasattr(command, "get_command") and argv and not argv[0].startswith("-"):
                context = command.make_context(command.name or "kinetic-prefect", [argv[0]], parent=context)
                sub = command.get_command(context, argv[0])
                if sub is None:
                    raise ClickException(f"no command {argv[0]!r}")
                command, argv = sub, argv[1:]
            command.make_context(command.name or "", list(argv), parent=context)
        except ClickException as exc:
            refused.append(f"{where}: {exc.format_message()}")
    assert not refused, "\n".join(refused)


_PREFECT_HELP = """
import contextlib, io, json, sys
from prefect.cli import app
codes = []
for words in json.loads(sys.argv[1]):
    sys.argv = ["prefect", *words, "--help"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            app()
            codes.append(0)
        except SystemExit as done:
            codes.append(done.code or 0)
print(json.dumps(codes))
"""


@pytest.mark.slow
def test_every_prefect_command_the_pages_print_exists():
    """`uv run prefect <command> ...` on a page names a command Prefect 3.9 has (`work-pool set-concurrency-limit`
    for GKE's slots, say). A few seconds: one process asks Prefect's console entry point for each command's --help
    (in a process of its own, as Prefect's CLI sets up settings and logging for the process it runs in)."""
    import json
    import subprocess
    import sys

    commands: dict[tuple[str, ...], str] = {}
    for page in DOC_PAGES:
        for span in _code_text(page.read_text()):
            for match in re.finditer(r"uv run prefect((?:\s+[a-z][a-z0-9-]*){1,2})", span):
                commands.setdefault(tuple(match.group(1).split()), f"{page.relative_to(ROOT)}: {span.strip()}")
    assert ("server", "start") in commands, sorted(commands)
    asked = sorted(commands)
    done = subprocess.run(
        [sys.executable, "-c", _PREFECT_HELP, json.dumps(asked)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    codes = json.loads(done.stdout.splitlines()[-1])
    unknown = [f"{' '.join(words)!r} ({commands[words]})" for words, code in zip(asked, codes) if code != 0]
    assert not unknown, "Prefect has no such command: " + "; ".join(unknown)


def _string_constants(path: Path) -> list[str]:
    import ast

    return [
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_no_message_offers_to_pip_install_the_package_from_an_index():
    """A fix the package or a flow prints installs from the checkout (`uv sync --inexact --extra gcp`, `pip install
    -e '.[gcp]'`): `pip install 'kinetic-prefect[gcp]'` finds no package on PyPI."""
    sources = [*sorted((ROOT / "kinetic_prefect").rglob("*.py")), *sorted((ROOT / "flows").rglob("*.py"))]
    offending = [
        f"{path.relative_to(ROOT)}: {text.strip()[:100]!r}"
        for path in sources
        for text in _string_constants(path)
        if re.search(r"pip install ['\"]?kinetic-prefect", text)
    ]
    assert not offending, offending
