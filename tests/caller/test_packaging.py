"""Caller-side packaging: ImageSpec tags, the call payload, and what of the project is shipped."""

from __future__ import annotations

import io
import re
import tarfile
import threading
import warnings

import pytest

from kinetic_prefect.caller.payload import archive_project, build_call_payload, collect_project_files
from kinetic_prefect.errors import PayloadError
from kinetic_prefect.shared.image import ImageSpec, RequirementsError, normalize_requirements

pytestmark = pytest.mark.no_server


def test_image_tag_is_stable_and_insensitive_to_spelling_and_order():
    a = ImageSpec.create(["Keras >= 3.8", "jax[CPU]==0.4.35"], family="gpu", python="3.11")
    b = ImageSpec.create(["jax[cpu]==0.4.35", "keras>=3.8"], family="gpu", python="3.11")
    assert a.tag == b.tag
    assert a.tag == ImageSpec.create(["keras>=3.8", "jax[cpu]==0.4.35"], family="gpu", python="3.11").tag
    assert a.tag.startswith("py311-gpu-") and len(a.tag.split("-")[-1]) == 16


@pytest.mark.parametrize(
    "change",
    [
        {"requirements": ["keras>=3.9", "jax[cpu]==0.4.35"]},
        {"python": "3.12"},
        {"family": "tpu"},
        {"base_image": "python:3.11-slim"},
    ],
)
def test_image_tag_changes_with_each_input(change):
    base = {"requirements": ["keras>=3.8", "jax[cpu]==0.4.35"], "family": "gpu", "python": "3.11"}
    assert ImageSpec.create(**base).tag != ImageSpec.create(**{**base, **change}).tag


def test_image_tag_changes_with_the_kinetic_version():
    spec = ImageSpec.create(["six"])
    assert spec.tag != ImageSpec(**{**spec.__dict__, "kinetic_version": "9.9.9"}).tag


def test_requirements_from_files(tmp_path):
    (tmp_path / "base.txt").write_text("numpy>=1.26  # arrays\n")
    (tmp_path / "requirements.txt").write_text("-r base.txt\n\n# comment\nKeras>=3\n")
    assert normalize_requirements(str(tmp_path / "requirements.txt")) == ("keras>=3", "numpy>=1.26")
    (tmp_path / "pyproject.toml").write_text('[project]\nname="x"\ndependencies=["Pillow>=10"]\n')
    assert normalize_requirements(tmp_path / "pyproject.toml") == ("pillow>=10",)
    (tmp_path / "bad.toml").write_text("[tool.x]\n")
    with pytest.raises(RequirementsError, match=r"no \[project\].dependencies"):
        normalize_requirements(tmp_path / "bad.toml")
    (tmp_path / "opts.txt").write_text("--index-url https://example.invalid\n")
    with pytest.raises(RequirementsError, match="opts.txt:1"):
        normalize_requirements(str(tmp_path / "opts.txt"))
    with pytest.raises(RequirementsError, match=r"requirements=\['keras'\]"):
        normalize_requirements("keras")


def test_payload_names_the_unpicklable_argument():
    def train(data, lock, epochs=1):
        return epochs

    with pytest.raises(PayloadError, match=r"argument 'lock' of train\(\) \(a lock\) cannot be pickled"):
        build_call_payload(train, ([1, 2],), {"lock": threading.Lock()}, None)
    with pytest.raises(PayloadError, match="do not match its signature"):
        build_call_payload(train, (), {"nope": 1}, None)


def _project(tmp_path):
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "model.py").write_text("X = 1\n")
    (root / "train.py").write_text("print('hi')\n")
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"\0" * 1000)
    (root / "notes.tmp").write_text("scratch")
    (root / ".venv" / "lib").mkdir(parents=True)
    (root / ".venv" / "lib" / "site.py").write_text("")
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"x")
    (root / ".gitignore").write_text("*.tmp\n")
    (root / ".kineticignore").write_text("data/\n")
    (root / "pyproject.toml").write_text("[project]\nname='proj'\n")
    return root


def test_project_files_respect_gitignore_kineticignore_and_defaults(tmp_path):
    root = _project(tmp_path)
    files = collect_project_files(root)
    assert files == [".gitignore", ".kineticignore", "pkg/model.py", "pyproject.toml", "train.py"]
    assert "train.py" not in collect_project_files(root, exclude=[root / "train.py"])


def test_project_archive_is_content_addressed_and_extractable(tmp_path):
    root = _project(tmp_path)
    first = archive_project(root)
    assert archive_project(root).sha256 == first.sha256
    (root / "train.py").write_text("print('changed')\n")
    changed = archive_project(root)
    assert changed.sha256 != first.sha256
    with tarfile.open(fileobj=io.BytesIO(changed.data), mode="r:gz") as tar:
        assert tar.extractfile("train.py").read() == b"print('changed')\n"
        assert all(m.mtime == 0 for m in tar.getmembers())


def test_secret_looking_files_are_warned_about(tmp_path):
    root = _project(tmp_path)
    (root / ".env").write_text("KAGGLE_KEY=abc\n")
    (root / "train.py").write_text("print('new content so the memo misses')\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        archive_project(root)
    assert any(".env" in str(w.message) and ".kineticignore" in str(w.message) for w in caught)


def test_docs_catalog_is_generated_from_the_code():
    from pathlib import Path

    from kinetic_prefect.cli.app import readme_with_catalog

    page = Path(__file__).resolve().parents[2] / "docs" / "accelerators.md"
    text = page.read_text()
    assert readme_with_catalog(text) == text, "run: uv run kinetic-prefect catalog --write-readme docs/accelerators.md"


def test_a_file_removed_while_the_project_is_packed_is_left_out(tmp_path, monkeypatch):
    """An editor's temporary file can vanish between the listing and the read: the call ships the tree as it is
    then, instead of failing with FileNotFoundError."""
    from kinetic_prefect.caller import project_archive

    (tmp_path / "train.py").write_text("x = 1\n")
    (tmp_path / ".train.py.swp").write_text("swap")
    listed = project_archive._select_project_files

    def listing_then_removal(root, exclude):
        selection = listed(root, exclude)
        (tmp_path / ".train.py.swp").unlink()  # gone after the listing, before the stat
        return selection

    monkeypatch.setattr(project_archive, "_select_project_files", listing_then_removal)
    archive = archive_project(tmp_path)
    with tarfile.open(fileobj=io.BytesIO(__import__("gzip").decompress(archive.data))) as tar:
        assert tar.getnames() == ["train.py"]


@pytest.mark.parametrize("inside", ["store", "cache"])
def test_a_store_or_cache_inside_the_project_is_never_shipped(tmp_path, monkeypatch, inside):
    """Issue 48, defect 3: with KINETIC_STORE=./kinetic-store (or the cache directory) inside the project, every call
    shipped the store in its project archive, earlier archives included: 2 MB became 34 MB after 4 calls. Three
    calls, each storing its archive and payload as a call does: the archive neither grows nor lists the folder."""
    from kinetic_prefect.caller.payload import cached_project_archive
    from kinetic_prefect.contract import RunLayout
    from kinetic_prefect.storage import LocalStore

    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname='proj'\n")
    (project / "train.py").write_text("def train(x):\n    return x\n" + "# padding\n" * 2000)
    monkeypatch.chdir(project)
    if inside == "store":
        monkeypatch.setenv("KINETIC_STORE", "./kinetic-store")
        folder = project / "kinetic-store"
    else:
        monkeypatch.delenv("KINETIC_STORE", raising=False)
        monkeypatch.setenv("KINETIC_CACHE_DIR", str(project / ".kinetic-cache"))
        folder = project / ".kinetic-cache"
    store = LocalStore(folder / "store" if inside == "cache" else folder)
    sizes, names = [], set()
    for call in range(3):
        archive = cached_project_archive(project)
        store.put_bytes(archive.key, archive.data)  # as a call uploads its code, then its payload
        store.put_bytes(RunLayout(f"run-{call}").payload, b"p" * 100_000)
        sizes.append(len(archive.data))
        with tarfile.open(fileobj=io.BytesIO(archive.data)) as tar:
            names |= set(tar.getnames())
    assert sizes[0] == sizes[1] == sizes[2], sizes
    assert names == {"pyproject.toml", "train.py"}, names


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"timeout_seconds": -1}, "timeout_seconds=-1: give a number of seconds above 0"),
        ({"timeout_seconds": 0}, "timeout_seconds=0: give a number of seconds above 0"),
        ({"retries": -1}, "retries=-1: give a whole number, 0 or more"),
    ],
)
def test_an_option_every_call_would_fail_on_is_refused_at_decoration(options, named):
    """Issue 48, defect 11: timeout_seconds=-1 and retries=-1 were accepted at decoration; a -1 timeout then failed
    every call with Prefect's "generator didn't yield"."""
    from kinetic_prefect import kinetic_task

    def double(x: int) -> int:
        return 2 * x

    with pytest.raises(ValueError, match=re.escape(named)):
        kinetic_task(**options)(double)
    task = kinetic_task(double)
    with pytest.raises(ValueError, match=re.escape(named)):
        task.with_options(**options)


def test_a_generator_function_is_refused_at_decoration():
    """Issue 48, defect 11: a generator function (or an async one) was accepted at decoration and failed at run."""
    from kinetic_prefect import kinetic_task

    def numbers(n: int):
        yield from range(n)

    async def numbers_async(n: int):
        for i in range(n):
            yield i

    with pytest.raises(ValueError, match=r"numbers\(\): it is a generator function .*return a list instead"):
        kinetic_task(numbers)
    with pytest.raises(ValueError, match=r"numbers_async\(\): it is an async generator function .*return a list"):
        kinetic_task(name="squares")(numbers_async)
