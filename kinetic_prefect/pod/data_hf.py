"""Job side of ``Data("hf://user/dataset")``: the dataset repository's files, downloaded with ``huggingface_hub``.

The download goes to the directory :mod:`kinetic_prefect.pod.data_localize` stages for the node cache, so the
function gets a plain directory of the repository's files (parquet, csv, json... as the repository holds them), to
open directly or with ``datasets.load_dataset(path)``. ``huggingface_hub`` reads its own settings from the job's
environment: ``HF_TOKEN`` for a gated or private dataset and ``HF_ENDPOINT`` for a mirror reach the job through
``env=["HF_TOKEN"]`` on the task. It is imported only when an hf:// Data is localized (the runner imports this
module, so the stdlib only at module level).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kinetic_prefect.pod.data_sources import DataError, parse_hf_url


def download_hf(url: str, dest: Path) -> int:
    """The files of the dataset repository ``url`` names, into ``dest``; returns how many there are."""
    repo_id, revision = parse_hf_url(url)
    try:
        import huggingface_hub
        from huggingface_hub import errors as hf_errors
    except ImportError:
        raise DataError(
            f"Data({url!r}) needs huggingface_hub in the job's environment: add 'huggingface_hub' to the "
            "task's requirements"
        ) from None
    try:
        huggingface_hub.snapshot_download(repo_id=repo_id, repo_type="dataset", revision=revision, local_dir=dest)
    except hf_errors.RevisionNotFoundError:
        raise DataError(
            f"Data({url!r}): the dataset {repo_id} has no revision {revision!r}: name a branch, tag or commit it has"
        ) from None
    except (hf_errors.RepositoryNotFoundError, hf_errors.GatedRepoError) as exc:
        raise DataError(
            f"Data({url!r}): the dataset {repo_id} was not found or is not readable ({type(exc).__name__}): check "
            "the name on huggingface.co/datasets; for a gated or private one, forward a token that may read it "
            "with env=['HF_TOKEN']"
        ) from None
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled, ConnectionError, TimeoutError) as exc:
        raise DataError(_unreachable(url, repo_id, exc)) from None
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # huggingface_hub's download bookkeeping, not the data
    files = [p for p in dest.rglob("*") if p.is_file()]
    if not files:
        raise DataError(f"Data({url!r}): the dataset {repo_id} has no files at revision {revision or 'main'}")
    return len(files)


def _unreachable(url: str, repo_id: str, exc: BaseException) -> str:
    from huggingface_hub import constants

    if constants.is_offline_mode():
        why = "downloads are off in the job (HF_HUB_OFFLINE is set)"
    else:
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        why = f"the Hugging Face Hub at {constants.ENDPOINT} was unreachable from the job ({cause[:200]})"
    return (
        f"Data({url!r}): {why}, and the dataset {repo_id} is not in the node cache: give the job network access "
        "to the Hub, or point HF_ENDPOINT at a mirror it can reach (forwarded with env=['HF_ENDPOINT'])"
    )
