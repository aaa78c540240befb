"""kinetic-gke: ``Data(..., fuse=True)`` as Cloud Storage FUSE CSI ephemeral volumes in the job's pods.

What GKE documents for an ephemeral volume
(https://cloud.google.com/kubernetes-engine/docs/how-to/persistent-volumes/cloud-storage-fuse-csi-driver-ephemeral):
the pod annotation ``gke-gcsfuse/volumes: "true"`` (GKE's webhook then injects the gcsfuse sidecar), a ``csi``
volume with driver ``gcsfuse.csi.storage.gke.io``, ``readOnly: true``, ``volumeAttributes.bucketName`` and an
``only-dir`` mount option for a prefix, and a read-only volume mount. Each mount id of ``gcs_fuse_mounts`` is
mounted at ``FUSE_MOUNT_ROOT/<id>``, and the job finds it there through ``KINETIC_FUSE_ROOT``. The pod's service
account must be allowed to read the buckets (Workload Identity); ``kinetic-prefect doctor`` names the binding.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

from kinetic_prefect.contract import FUSE_MOUNT_ROOT, Env

CSI_DRIVER = "gcsfuse.csi.storage.gke.io"
SIDECAR_ANNOTATION = "gke-gcsfuse/volumes"
# implicit-dirs: a prefix written without "folder" placeholder objects (gsutil cp -r, the store's uploads) lists
MOUNT_OPTIONS = "implicit-dirs"
_MOUNT_ID = re.compile(r"[0-9a-f]{16}")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")


def volume_source(url: str) -> tuple[str, str]:
    """``gs://bucket/dir`` → (bucket, dir); refuses what a volume cannot mount, naming it."""
    parsed = urllib.parse.urlsplit(url)
    bucket, directory = parsed.netloc, parsed.path.strip("/")
    if parsed.scheme != "gs" or not _BUCKET.fullmatch(bucket) or parsed.query or parsed.fragment or "," in directory:
        raise ValueError(
            f"gcs_fuse_mounts: {url!r} is not a gs://bucket/dir a Cloud Storage FUSE volume can mount (no commas, "
            "no query); the caller sets this variable for Data(..., fuse=True): leave it empty on the pool"
        )
    return bucket, directory


def volumes(mounts: dict[str, str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's ``volumes`` and the container's ``volumeMounts`` for ``{mount id: gs://bucket/dir}``."""
    pod_volumes, container_mounts = [], []
    for mount_id, url in sorted(mounts.items()):
        if not _MOUNT_ID.fullmatch(mount_id):
            raise ValueError(f"gcs_fuse_mounts: {mount_id!r} is not a mount id (16 hex digits, set by the caller)")
        bucket, directory = volume_source(url)
        options = MOUNT_OPTIONS + (f",only-dir={directory}" if directory else "")
        name = f"gcsfuse-{mount_id}"
        pod_volumes.append(
            {
                "name": name,
                "csi": {
                    "driver": CSI_DRIVER,
                    "readOnly": True,
                    "volumeAttributes": {"bucketName": bucket, "mountOptions": options},
                },
            }
        )
        container_mounts.append({"name": name, "mountPath": f"{FUSE_MOUNT_ROOT}/{mount_id}", "readOnly": True})
    return pod_volumes, container_mounts


def render(manifest: dict[str, Any], mounts: dict[str, str]) -> None:
    """Add the FUSE volumes of ``mounts`` to a Job manifest (nothing for none)."""
    if not mounts:
        return
    pod_volumes, container_mounts = volumes(mounts)
    template = manifest["spec"]["template"]
    annotations = template.setdefault("metadata", {}).setdefault("annotations", None) or {}
    template["metadata"]["annotations"] = {**annotations, SIDECAR_ANNOTATION: "true"}
    pod = template["spec"]
    pod["volumes"] = [*(pod.get("volumes") or []), *pod_volumes]
    container = pod["containers"][0]
    container["volumeMounts"] = [*(container.get("volumeMounts") or []), *container_mounts]
    env = [e for e in container.get("env") or [] if e.get("name") != Env.FUSE_ROOT]
    container["env"] = [*env, {"name": Env.FUSE_ROOT, "value": FUSE_MOUNT_ROOT}]
