"""A dataset's source, checked before anything is hashed or stored: a gs:// or hf:// URL, or a local file or
directory.

A gs:// URL is split into its bucket and object path (no network here: the job fetches it). A local source is
listed following the symlinks that stay inside it; every file in it must be readable and have a name an object store
can keep, and a link out of the directory (``extra -> ~/.ssh/id_rsa``: what the directory holds is uploaded, never
what a link reaches on this machine), a broken link, a symlink loop, a special file or an empty directory is
refused. A link out is refused rather than skipped: a dataset missing files it seems to hold would train on less
without a word. Each refusal is a
:class:`DataError` naming the path or URL and the fix.

The job runner imports this module (through :mod:`kinetic_prefect.pod.data`): the stdlib only.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path


class DataError(ValueError):
    """A dataset argument that cannot be used; the message names the path or URL and the fix."""


def parse_gs_url(url: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` → ("bucket", "a/b"); ``gs://bucket/a/`` → ("bucket", "a/"); bucket only → ("bucket", "")."""
    parsed = urllib.parse.urlsplit(url)
    bucket, path = parsed.netloc, parsed.path.lstrip("/")
    if parsed.scheme != "gs" or not bucket or parsed.query or parsed.fragment:
        raise DataError(f"invalid data URL {url!r}: use gs://bucket/object or gs://bucket/prefix/")
    if any(part in (".", "..") for part in path.split("/")) or "//" in path or "\\" in path:
        raise DataError(
            f"invalid data URL {url!r}: empty, '.' and '..' segments and backslashes are not "
            "supported in the object path; name the object or prefix exactly"
        )
    return bucket, path


def check_fuse_url(url: str) -> None:
    """A gs:// URL a Cloud Storage FUSE volume can mount: its prefix goes into the ``only-dir`` mount option of a
    comma-separated list, so a comma in it cannot be passed."""
    _bucket, path = parse_gs_url(url)
    if "," in path:
        raise DataError(
            f"Data({url!r}, fuse=True): the object path has a comma, which Cloud Storage FUSE's only-dir mount "
            "option cannot carry; rename the prefix, mount its parent, or drop fuse=True (the job downloads it)"
        )


_HF_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def parse_hf_url(url: str) -> tuple[str, str | None]:
    """``hf://user/dataset?revision=v1`` → ("user/dataset", "v1"): a Hugging Face dataset repository, as Kinetic
    spells it. The job downloads the repository's files; ``split``/``config_name`` (Kinetic's ``datasets`` loader)
    are refused with the way to load a split from those files."""
    parsed = urllib.parse.urlsplit(url)
    repo_id = (parsed.netloc + parsed.path).strip("/")
    if parsed.scheme != "hf" or not _HF_REPO.fullmatch(repo_id) or parsed.fragment:
        raise DataError(f"invalid data URL {url!r}: use hf://dataset or hf://user/dataset (optionally ?revision=REV)")
    query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
    loader = sorted(set(query) & {"split", "config_name"})
    if loader:
        raise DataError(
            f"Data({url!r}): {'/'.join(loader)} is not applied here: the job gets the dataset repository's files "
            "(huggingface_hub), not a saved `datasets` split. Drop it and load the split in the function: "
            "datasets.load_dataset(path, name=CONFIG, split='train')"
        )
    unknown = sorted(set(query) - {"revision"})
    if unknown or any(len(v) != 1 or not v[0] for v in query.values()):
        raise DataError(f"Data({url!r}): the only query an hf:// URL takes is ?revision=BRANCH_TAG_OR_COMMIT")
    return repo_id, query.get("revision", [None])[0]


def unreadable_error(path: Path | str, exc: BaseException | None = None) -> DataError:
    why = f" ({exc.strerror or exc})" if isinstance(exc, OSError) else ""
    return DataError(
        f"data file {path} is not readable{why}: fix its permissions (chmod a+r) or move it out of the data directory"
    )


def _check_file(path: str) -> None:
    if not os.access(path, os.R_OK):
        raise unreadable_error(path, PermissionError(13, "permission denied"))


def check_store_name(rel: str, path: str) -> None:
    """Every relative path becomes a store key / GCS object name."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(
            f"data file {path!r} has a name that is not valid UTF-8: rename it (object stores keep UTF-8 names only)"
        ) from None
    if "\\" in rel or "\n" in rel or "\r" in rel:
        raise DataError(
            f"data file {path!r} has a backslash or a line break in its name: rename it "
            "(object stores cannot keep such names)"
        )


def _refuse_link_out(entry: os.DirEntry[str], root: Path, real_root: str) -> None:
    target = os.path.realpath(entry.path)
    if target == real_root or target.startswith(real_root.rstrip(os.sep) + os.sep):
        return
    raise DataError(
        f"data path {entry.path} is a symbolic link to {target}, outside the data directory {root}: what a link "
        "reaches out of the directory is not uploaded. Copy it into the data directory (replace the link by the "
        f"file), or pass {target} as a Data argument of its own"
    )


def walk_files(root: Path) -> Iterator[tuple[str, str, os.DirEntry[str]]]:
    """Every file under ``root`` as (relative posix path, path, entry), following the symlinks that stay under
    ``root`` (``root`` itself may be one: the user named it); raises DataError for a link out of ``root``, broken
    links, special files, unreadable directories and symlink loops."""
    try:
        top = os.stat(root)
    except OSError as exc:
        raise unreadable_error(root, exc) from exc
    real_root = os.path.realpath(root)
    stack: list[tuple[str, str, frozenset[tuple[int, int]]]] = [(str(root), "", frozenset({(top.st_dev, top.st_ino)}))]
    while stack:
        dir_path, rel_dir, ancestors = stack.pop()
        try:
            with os.scandir(dir_path) as it:
                entries = list(it)
        except OSError as exc:
            raise DataError(
                f"data directory {dir_path} cannot be listed ({exc.strerror or exc}): fix its "
                "permissions (chmod a+rx) or move it out of the data directory"
            ) from exc
        for entry in entries:
            rel = rel_dir + entry.name
            if entry.is_symlink() and os.path.exists(entry.path):  # a broken link is named below
                _refuse_link_out(entry, root, real_root)
            try:
                is_dir = entry.is_dir()  # follows symlinks
                is_file = not is_dir and entry.is_file()
            except OSError as exc:
                raise unreadable_error(entry.path, exc) from exc
            if is_dir:
                try:
                    st = entry.stat()
                except OSError as exc:
                    raise unreadable_error(entry.path, exc) from exc
                ident = (st.st_dev, st.st_ino)
                if ident in ancestors:
                    raise DataError(
                        f"data directory {entry.path} is a symlink loop (it links to one of its "
                        "parents): remove the link or pass a directory without loops"
                    )
                stack.append((entry.path, rel + "/", ancestors | {ident}))
            elif is_file:
                check_store_name(rel, entry.path)
                yield rel, entry.path, entry
            elif entry.is_symlink():
                raise DataError(
                    f"data file {entry.path} is a broken symbolic link (its target "
                    f"{_readlink(entry.path)!r} does not exist): fix or remove the link"
                )
            else:
                raise DataError(
                    f"data path {entry.path} is not a regular file (a fifo, socket or device): "
                    "move it out of the data directory"
                )


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def validate_local(path: Path) -> None:
    if not os.path.exists(path):
        if os.path.islink(path):
            raise DataError(
                f"data path {path} is a broken symbolic link (its target {_readlink(str(path))!r} "
                "does not exist): fix the link or pass the real path"
            )
        raise DataError(
            f"data path {path} does not exist: check the path (relative paths are resolved against "
            f"the working directory {os.getcwd()})"
        )
    if os.path.isdir(path):
        found = False
        for _rel, file_path, _entry in walk_files(path):
            _check_file(file_path)
            found = True
        if not found:
            raise DataError(
                f"data directory {path} is empty (no files at any depth): put the data in it or pass "
                "the directory that holds it"
            )
        return
    if not os.path.isfile(path):
        raise DataError(
            f"data path {path} is not a regular file or directory (a fifo, socket or device): "
            "pass a file or a directory"
        )
    check_store_name(path.name, str(path))
    _check_file(str(path))
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise unreadable_error(path, exc) from exc
