"""A throw-away PostgreSQL cluster for a Prefect server (Debian's ``postgresql`` package, a temp dir, a free port).

Used by the test session (``KINETIC_TEST_DATABASE=postgresql``, see conftest.py) and the benchmarks
(``bench/server.py``): a production Prefect server runs on PostgreSQL, the embedded default on SQLite.
PostgreSQL refuses to run as root, so under root the cluster belongs to the ``postgres`` user Debian's
package creates.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

DATABASE = "prefect"
USER = "kinetic"


class PostgresUnavailable(RuntimeError):
    pass


def _bin_dir() -> Path:
    """The newest installed server's programs (``initdb``, ``pg_ctl`` are not on PATH on Debian)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).resolve().parent
    raise PostgresUnavailable(
        "PostgreSQL is not installed: `apt-get install postgresql` (Debian's package) "
        "provides initdb and pg_ctl under /usr/lib/postgresql/<version>/bin"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _as_cluster_owner() -> tuple[list[str], int | None, int | None]:
    """The command prefix that runs a server program as a user PostgreSQL accepts, and that user's ids."""
    if os.geteuid() != 0:
        return [], None, None
    try:
        owner = pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresUnavailable(
            "running as root, and there is no `postgres` user to own the cluster "
            "(Debian's postgresql package creates it)"
        ) from None
    return ["runuser", "-u", "postgres", "--"], owner.pw_uid, owner.pw_gid


@contextlib.contextmanager
def postgres_cluster(durable: bool = False) -> Iterator[str]:
    """Start a cluster, yield Prefect's database URL (asyncpg), stop and delete it on exit.

    ``durable=False`` turns fsync off: a test cluster that dies with its tests needs no crash safety, and on a
    loaded machine fsync dominates. Benchmarks pass ``durable=True`` to keep the production setting.
    """
    bin_dir = _bin_dir()
    prefix, uid, gid = _as_cluster_owner()
    root = Path(tempfile.mkdtemp(prefix="kinetic-pg-"))
    data, sockets = root / "data", root / "sockets"
    sockets.mkdir()
    if uid is not None:
        os.chown(root, uid, gid)
        os.chown(sockets, uid, gid)
    port = _free_port()
    log = root / "postgres.log"

    def run(*args: str) -> None:
        proc = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            raise PostgresUnavailable(
                f"{' '.join(args[:2])} failed:\n{proc.stdout}{proc.stderr}"
                + (log.read_text()[-2000:] if log.exists() else "")
            )

    run(str(bin_dir / "initdb"), "-D", str(data), "-U", USER, "-A", "trust", "-E", "UTF8", "--no-sync")
    options = f"-p {port} -k {sockets} -c listen_addresses=127.0.0.1 -c max_connections=200"
    if not durable:
        options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "120", "start")
    try:
        run(str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", USER, DATABASE)
        yield f"postgresql+asyncpg://{USER}@127.0.0.1:{port}/{DATABASE}"
    finally:
        subprocess.run(
            [*prefix, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
            capture_output=True,
            timeout=120,
        )
        shutil.rmtree(root, ignore_errors=True)


def prefect_tables(url: str) -> list[str]:
    """The tables Prefect made in the cluster's database: proof that a server really runs on it."""
    import asyncio

    import asyncpg

    async def read() -> list[str]:
        connection = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            rows = await connection.fetch("select tablename from pg_tables where schemaname = 'public'")
        finally:
            await connection.close()
        return sorted(row["tablename"] for row in rows)

    return asyncio.run(read())
