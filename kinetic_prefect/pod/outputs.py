"""A job's durable outputs, reachable from the flow that called it.

Inside a job, files written to ``$KINETIC_OUTPUT_DIR`` are uploaded to the store when the job ends.
To hand them to later steps, return ``JobOutputs.current()`` (a small picklable reference) with the
job's value, then, on the caller's side::

    @kinetic_task(accelerator="l4")
    def train(...) -> dict:
        ...  # writes model.keras into os.environ["KINETIC_OUTPUT_DIR"]
        return {"metrics": m, "outputs": JobOutputs.current()}

    trained = train(...)
    trained["outputs"].download("model.keras", "models/")     # or .url("model.keras"), .download_all(dir)

No step rebuilds store keys itself: where outputs live is ``contract.RunLayout``'s business. This
module imports only the stdlib, the contract and the store (it ships with the job runner).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kinetic_prefect.contract import Env, RunLayout, settings

if TYPE_CHECKING:
    from kinetic_prefect.storage import Store


@dataclass(frozen=True)
class JobOutputs:
    """The outputs of one job: ``store`` is the store URL, ``run_id`` the job's run in it."""

    store: str
    run_id: str
    local_dir: str | None = None  # set when the function ran as a plain call (no job, no upload)

    @classmethod
    def current(cls) -> JobOutputs:
        """The outputs of the job this code runs in (outside a job: the local output folder, if any)."""
        store, run_id = settings.STORE.value(), os.environ.get(Env.RUN_ID)
        if store and run_id:
            return cls(store=store, run_id=run_id)
        return cls(store="", run_id="", local_dir=os.environ.get(Env.OUTPUT_DIR) or os.getcwd())

    def _store(self) -> Store:
        from kinetic_prefect.storage import open_store

        return open_store(self.store)

    def names(self) -> list[str]:
        """Relative paths of every output file."""
        if self.local_dir is not None:
            root = Path(self.local_dir)
            return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        prefix = RunLayout(self.run_id).outputs + "/"
        return sorted(key[len(prefix) :] for key in self._store().list(prefix) if key.startswith(prefix))

    def url(self, name: str) -> str:
        if self.local_dir is not None:
            return str(Path(self.local_dir) / name)
        return self._store().url_for(RunLayout(self.run_id).output(name))

    def download(self, name: str, dest_dir: str | os.PathLike[str]) -> Path:
        """Copy one output into ``dest_dir`` (keeping its relative path); returns the local path."""
        target = Path(dest_dir) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if self.local_dir is not None:
            import shutil

            source = Path(self.local_dir) / name
            if source.resolve() != target.resolve():
                shutil.copyfile(source, target)
            return target
        self._store().get_file(RunLayout(self.run_id).output(name), target)
        return target

    def download_all(
        self, dest_dir: str | os.PathLike[str], include: Callable[[str], bool] = lambda name: True
    ) -> list[Path]:
        return [self.download(name, dest_dir) for name in self.names() if include(name)]
