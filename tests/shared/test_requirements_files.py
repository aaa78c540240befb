"""A requirements file read as pip reads its includes: ``-r X``, ``-rX``, ``--requirement X`` and
``--requirement=X`` pull another file in (relative to the including file); a constraints file (``-c``) is refused,
naming the line, since the job's environment is built from requirements alone and a constraint read as a package
would install it; a file that includes itself, directly or through others, is refused naming the files."""

from __future__ import annotations

import pytest

from kinetic_prefect import kinetic_task
from kinetic_prefect.shared.image import ImageSpec, RequirementsError

pytestmark = pytest.mark.no_server


def _body() -> None:
    pass


@pytest.mark.parametrize(
    "include", ["-r base.txt", "-rbase.txt", "--requirement base.txt", "--requirement=base.txt", "-r  base.txt  # ok"]
)
def test_every_spelling_of_an_include_pulls_the_other_file_in(tmp_path, include):
    (tmp_path / "base.txt").write_text("numpy>=1.26\n")
    top = tmp_path / "requirements.txt"
    top.write_text(f"{include}\nkeras>=3.8\n")
    assert ImageSpec.create(str(top)).requirements == ("keras>=3.8", "numpy>=1.26")


def test_an_include_is_read_relative_to_the_file_that_names_it(tmp_path):
    (tmp_path / "deps").mkdir()
    (tmp_path / "deps" / "base.txt").write_text("-r common.txt\nnumpy\n")
    (tmp_path / "deps" / "common.txt").write_text("rich\n")
    top = tmp_path / "requirements.txt"
    top.write_text("--requirement=deps/base.txt\n")
    assert ImageSpec.create(str(top)).requirements == ("numpy", "rich")


@pytest.mark.parametrize("line", ["-c constraints.txt", "-cconstraints.txt", "--constraint=constraints.txt"])
def test_a_constraints_file_is_refused_not_installed_as_packages(tmp_path, line):
    (tmp_path / "constraints.txt").write_text("urllib3<2\n")
    top = tmp_path / "requirements.txt"
    top.write_text(f"requests\n{line}\n")
    with pytest.raises(RequirementsError) as refused:
        kinetic_task(name="constrained", requirements=str(top))(_body)  # at decoration, before anything is built
    message = str(refused.value)
    assert f"{top}:2" in message and "constraints.txt" in message, message
    assert "pin" in message, "the message says how to hold a version instead"


def test_a_file_that_includes_itself_is_refused_naming_the_cycle(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("numpy\n-r b.txt\n")
    b.write_text("rich\n--requirement=a.txt\n")
    with pytest.raises(RequirementsError) as refused:
        ImageSpec.create(str(a))
    message = str(refused.value)
    assert "includes itself" in message and f"{a} -> {b} -> {a}" in message, message
    itself = tmp_path / "self.txt"
    itself.write_text("-r self.txt\n")
    with pytest.raises(RequirementsError, match="includes itself"):
        ImageSpec.create(str(itself))


def test_a_file_included_twice_without_a_cycle_is_read_once(tmp_path):
    (tmp_path / "base.txt").write_text("numpy\n")
    (tmp_path / "gpu.txt").write_text("-r base.txt\njax\n")
    top = tmp_path / "requirements.txt"
    top.write_text("-r base.txt\n-r gpu.txt\n")
    assert ImageSpec.create(str(top)).requirements == ("jax", "numpy")


@pytest.mark.parametrize(("line", "named"), [("-r", "names no file"), ("-r missing.txt", "missing.txt")])
def test_an_include_with_no_file_or_a_missing_one_names_the_line(tmp_path, line, named):
    top = tmp_path / "requirements.txt"
    top.write_text(f"numpy\n{line}\n")
    with pytest.raises(RequirementsError) as refused:
        ImageSpec.create(str(top))
    assert f"{top}:2" in str(refused.value) and named in str(refused.value), refused.value
