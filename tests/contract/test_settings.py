"""The settings table (``kinetic_prefect/contract/settings.py``) is the one way a ``KINETIC_*`` setting is read, the
settings page is generated from it, and a bad value fails naming the variable and the fix."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kinetic_prefect
from kinetic_prefect import contract
from kinetic_prefect.contract import settings

pytestmark = pytest.mark.no_server

PACKAGE_DIR = Path(kinetic_prefect.__file__).parent
REPO_DIR = PACKAGE_DIR.parent
SETTING_NAMES = {setting.name for setting in settings.TABLE}


def test_the_settings_page_is_generated_from_the_table() -> None:
    page = REPO_DIR / settings.PAGE_PATH
    assert page.read_text() == settings.markdown_page(), (
        f"{settings.PAGE_PATH} is out of date: run "
        f"`uv run python -m kinetic_prefect.contract.settings --write {settings.PAGE_PATH}`"
    )
    assert settings.main(["--check", str(page)]) == 0


def test_the_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "settings.md"
    stale.write_text(settings.markdown_page().replace("KINETIC_STORE", "KINETIC_STOR"))
    assert settings.main(["--check", str(stale)]) == 1
    assert settings.main(["--write", str(stale)]) == 0
    assert settings.main(["--check", str(stale)]) == 0


def test_every_kinetic_variable_is_a_setting_or_set_by_the_worker() -> None:
    """The page names every variable: each ``Env`` name (and the outage variable) is in exactly one list."""
    env_names = {v for k, v in vars(contract.Env).items() if not k.startswith("_")} | {contract.API_OUTAGE_SECONDS_VAR}
    worker_set = set(settings.SET_BY_THE_WORKER)
    assert not SETTING_NAMES & worker_set
    assert SETTING_NAMES | worker_set == env_names
    assert len(SETTING_NAMES) == len(settings.TABLE)
    page = settings.markdown_page()
    assert all(f"`{name}`" in page for name in env_names)


def _aliases(trees: list[ast.Module]) -> dict[str, str]:
    """Names that stand for a setting's variable: ``Env.X`` attributes, the contract's own ``..._VAR`` strings,
    and module-level aliases such as ``KEY_ENV = Env.SIGNING_KEY`` (read as ``KEY_ENV`` or ``signing.KEY_ENV``)."""
    found = {k: v for k, v in vars(contract.Env).items() if v in SETTING_NAMES}
    found |= {k: v for k, v in vars(contract).items() if isinstance(v, str) and v in SETTING_NAMES}
    for tree in trees:
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target = _named(node.value, found)
                if target is not None:
                    found[node.targets[0].id] = target
    return found


def _named(node: ast.AST, aliases: dict[str, str]) -> str | None:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return aliases.get(name) if name is not None else None


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` (or ``environ`` imported from os). A copy the code made of it (the warm runner's
    ``base_environ``, holding what the worker set for the job) is not the process's settings: not counted."""
    if isinstance(node, ast.Attribute) and node.attr == "environ":
        return True
    return isinstance(node, ast.Name) and node.id == "environ"


def environ_reads(tree: ast.Module, aliases: dict[str, str]) -> list[tuple[int, str]]:
    """``(line, variable)`` of each read of a setting's variable straight from an environment mapping."""
    reads: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        key: ast.AST | None = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            read = isinstance(func, ast.Attribute) and (
                (func.attr in ("get", "pop") and _is_environ(func.value)) or func.attr == "getenv"
            )
            if read:
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = node.slice
        elif (
            isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
            and any(_is_environ(c) for c in node.comparators)
        ):
            key = node.left
        if key is None:
            continue
        variable = key.value if isinstance(key, ast.Constant) and key.value in SETTING_NAMES else _named(key, aliases)
        if variable is not None:
            reads.append((node.lineno, variable))
    return reads


def test_no_setting_is_read_around_the_table() -> None:
    paths = [p for p in sorted(PACKAGE_DIR.rglob("*.py")) if p != PACKAGE_DIR / "contract" / "settings.py"]
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in paths}
    aliases = _aliases(list(trees.values()))
    offenders = [
        f"{path.relative_to(PACKAGE_DIR)}:{line}: {variable}"
        for path, tree in trees.items()
        for line, variable in environ_reads(tree, aliases)
    ]
    assert not offenders, "settings read from the environment directly (use settings.X.value()):\n" + "\n".join(
        offenders
    )


def test_the_read_scan_sees_every_way_of_reading(tmp_path: Path) -> None:
    tree = ast.parse(
        "import os\nfrom kinetic_prefect.contract import Env\nKEY = Env.SIGNING_KEY\n"
        "a = os.environ.get(Env.STORE)\nb = os.environ[KEY]\nc = os.getenv('KINETIC_WORK_POOL')\n"
        "d = Env.PAYLOAD_CACHE in os.environ\ne = base_environ.get(Env.STORE)\n"
        "f = signing.KEY\ng = os.environ.get(Env.RUN_ID)\n"
    )
    reads = environ_reads(tree, _aliases([tree]))
    assert reads == [
        (4, contract.Env.STORE),
        (5, contract.Env.SIGNING_KEY),
        (6, contract.Env.WORK_POOL),
        (7, contract.Env.PAYLOAD_CACHE),
    ]


def test_a_bad_value_names_the_variable_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from kinetic_prefect.caller.payload import payload_warn_bytes

    monkeypatch.setenv(contract.Env.PAYLOAD_WARN_BYTES, "abc")
    with pytest.raises(settings.SettingError, match=r"KINETIC_PAYLOAD_WARN_BYTES='abc': give a whole number of bytes"):
        payload_warn_bytes()
    monkeypatch.setenv(contract.Env.PAYLOAD_WARN_BYTES, "2_000_000")
    assert payload_warn_bytes() == 2_000_000


@pytest.mark.parametrize(
    "setting",
    [s for s in settings.TABLE if s.parse not in (settings.parse_text, settings.parse_names, settings.parse_key)],
    ids=lambda s: s.name,
)
def test_every_typed_setting_refuses_a_wrong_value_by_name(setting: settings.Setting, monkeypatch) -> None:
    monkeypatch.setenv(setting.name, "-x")
    with pytest.raises(ValueError, match=f"^{setting.name}='-x': .*unset it for the default"):
        setting.value()


def test_a_setting_is_read_when_used_and_blank_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from kinetic_prefect.shared.outages import outage_horizon_seconds

    monkeypatch.delenv(contract.API_OUTAGE_SECONDS_VAR, raising=False)
    assert outage_horizon_seconds() == contract.DEFAULT_API_OUTAGE_SECONDS
    monkeypatch.setenv(contract.API_OUTAGE_SECONDS_VAR, "30")
    assert outage_horizon_seconds() == 30.0
    monkeypatch.setenv(contract.API_OUTAGE_SECONDS_VAR, " ")
    assert outage_horizon_seconds() == contract.DEFAULT_API_OUTAGE_SECONDS
    monkeypatch.setenv(contract.Env.PAYLOAD_CACHE, "off")
    assert settings.PAYLOAD_CACHE.value() is False
    # Blank is a value for the local devices: no device but the CPU (unset: detect them).
    assert settings.LOCAL_DEVICES.value({contract.Env.LOCAL_DEVICES: ""}) == ()
    assert settings.LOCAL_DEVICES.value({}) is None
    from kinetic_prefect.accelerators import local_platform_available

    monkeypatch.setenv(contract.Env.LOCAL_DEVICES, "")
    assert local_platform_available("cpu") and not local_platform_available("cuda")
    monkeypatch.setenv(contract.Env.LOCAL_DEVICES, "cuda, tpu")
    assert local_platform_available("cuda") and local_platform_available("tpu")
