"""``@kinetic.run(...)``: Keras Kinetic's decorator, made of a ``@kinetic_task`` (the one code path for jobs).

A blocking call is the kinetic task's call: inside a flow it is a task run of that flow (retries, caching,
the UI), outside one it runs in a flow made for it. ``run_async`` submits the same call as a detached job
(kinetic_prefect.kinetic.jobs, .detached); ``run_async_map`` submits a batch of them (kinetic_prefect.kinetic.batch).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from kinetic_prefect.accelerator_names import kinetic_reading
from kinetic_prefect.contract import FUSE_MOUNT_ROOT, Env

KINETIC_DEFAULT_ACCELERATOR = "tpu-v5e-1"  # Kinetic's default; on a machine without it, kinetic-local uses the CPU

_POOL_HOLDS_IT = (
    "has no per-call equivalent here: a work pool holds where jobs run (a kinetic-gke pool's "
    "project, zone, cluster and namespace); create one for that cluster and pass work_pool='NAME' "
    f"(or set {Env.WORK_POOL})"
)
_NO_EQUIVALENT: dict[str, str] = {
    "zone": _POOL_HOLDS_IT,
    "project": _POOL_HOLDS_IT,
    "cluster": _POOL_HOLDS_IT,
    "namespace": _POOL_HOLDS_IT,
    "base_image_repo": "has no equivalent (no prebuilt base images are pulled); the nearest is base_image='IMAGE', "
    "the base of the image built for requirements= on kinetic-gke",
}


def _check_kinetic_options(kinetic_options: dict[str, Any]) -> dict[str, Any]:
    """Kinetic's options that exist here, translated to kinetic_task's; the others fail, naming the nearest."""
    translated: dict[str, Any] = {}
    for name, value in kinetic_options.items():
        if name in _NO_EQUIVALENT:
            if value in (None, False):
                continue
            raise TypeError(f"kinetic.run({name}={value!r}) {_NO_EQUIVALENT[name]}.")
        if name == "backend":
            if value in (None, "gke"):
                continue
            raise TypeError(
                f"kinetic.run(backend={value!r}) has no equivalent: multi-host jobs need no separate "
                "backend here; name a multi-host slice (accelerator='v5litepod-16') or pass hosts=N."
            )
        if name == "debug":  # the same debug mode: debugpy in the job, `kinetic-prefect jobs debug JOB` attaches
            if value is not False:  # True, or what TaskOptions refuses naming it (debug="false")
                translated["debug"] = value
            continue
        if name == "container_image":
            if value not in (None, "bundled", "prebuilt"):  # both mean: an environment with the requirements
                translated["image"] = value
            continue
        raise TypeError(f"kinetic.run() got an unexpected option {name!r}")
    return translated


def with_volumes(fn: Callable[..., Any], output_dir: str | None) -> Callable[..., Any]:
    """The job-side body for ``volumes=`` / ``output_dir=``: the volumes' ``Data`` arrive as local paths (like any
    ``Data`` argument) and are linked at their mount paths for the call; ``output_dir`` becomes the function's
    ``KINETIC_OUTPUT_DIR``. Nested, so cloudpickle ships it by value (the job needs no kinetic package)."""

    def run_with_volumes(volumes: dict[str, str], args: tuple, kwargs: dict[str, Any]) -> Any:
        linked = []
        try:
            for mount, path in volumes.items():
                if os.path.lexists(mount):
                    if os.path.realpath(mount) == os.path.realpath(path):
                        continue
                    raise FileExistsError(
                        f"volumes={{{mount!r}: ...}}: {mount} already exists on the job's host; "
                        "mount the Data at a path that does not exist yet (or pass it as an "
                        "argument)"
                    )
                os.makedirs(os.path.dirname(mount.rstrip("/")) or "/", exist_ok=True)
                os.symlink(path, mount.rstrip("/"))
                linked.append(mount.rstrip("/"))
            if output_dir:
                if "://" not in output_dir:
                    os.makedirs(output_dir, exist_ok=True)
                os.environ[Env.OUTPUT_DIR] = output_dir
            return fn(*args, **kwargs)
        finally:
            for mount in linked:
                os.unlink(mount)

    run_with_volumes.__name__ = fn.__name__
    run_with_volumes.__doc__ = fn.__doc__
    return run_with_volumes


class RemoteCallable:
    """What ``@kinetic.run`` returns: call it (blocking), ``run_async`` it (a ``JobHandle``) or ``run_async_map`` it
    (a ``BatchHandle``). ``.task`` is the underlying ``@kinetic_task`` (``.submit()``, ``.map()``, ``with_options``)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        accelerator: str,
        volumes: dict[str, Any] | None,
        output_dir: str | None,
        spot: bool,
        capture_env_vars: list[str] | None,
        task_options: dict[str, Any],
    ):
        from kinetic_prefect.caller.decorator import kinetic_task
        from kinetic_prefect.caller.options import check_yes_no

        check_yes_no("spot", spot)  # spot="no" is not spot capacity
        spec = kinetic_reading(accelerator)
        if spot:
            spec = spec.with_spot(True)
        for mount in volumes or {}:
            if not isinstance(mount, str) or not os.path.isabs(mount):
                raise ValueError(f"volumes: mount path {mount!r} must be an absolute path, e.g. '/data'")
            if (mount.rstrip("/") + "/").startswith(FUSE_MOUNT_ROOT + "/"):
                raise ValueError(
                    f"volumes: mount path {mount!r} is below {FUSE_MOUNT_ROOT}/, where FUSE data is mounted "
                    "(as in Kinetic); use another path, e.g. '/data'"
                )
        self.fn = fn
        self.accelerator = spec
        self.volumes = dict(volumes or {})
        self.output_dir = output_dir
        self._adapted = bool(self.volumes or output_dir)
        self._body = with_volumes(fn, output_dir) if self._adapted else fn
        # a lambda has no name a Prefect flow may carry: Kinetic accepts one, so it is named for what it is
        task_options.setdefault("name", "lambda" if fn.__name__ == "<lambda>" else fn.__name__)
        self.task = kinetic_task(  # type: ignore[call-overload]
            self._body, accelerator=spec, env=list(capture_env_vars or ()), env_missing="warn", **task_options
        )
        functools.update_wrapper(self, fn)

    def call_args(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """The task's arguments for one call (``volumes=``/``output_dir=`` wrap them)."""
        if self._adapted:
            return (self.volumes, args, kwargs), {}
        return args, kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from prefect import flow
        from prefect.context import FlowRunContext

        call_args, call_kwargs = self.call_args(args, kwargs)
        stop_forward = None
        if self.task.kinetic.debug:  # as Kinetic does: the blocking call opens the way to its job's debugger
            from kinetic_prefect.kinetic.debug import forward_for_call

            stop_forward = forward_for_call(self.task.name)
        try:
            if FlowRunContext.get() is not None:
                return self.task(*call_args, **call_kwargs)

            @flow(name="kinetic-run", flow_run_name=self.fn.__name__, validate_parameters=False)
            def kinetic_run() -> Any:
                return self.task(*call_args, **call_kwargs)

            return kinetic_run()
        finally:
            if stop_forward is not None:
                stop_forward.set()

    def run_async(self, *args: Any, **kwargs: Any) -> Any:
        """Submit the call as a detached job and return its ``JobHandle`` at once."""
        from kinetic_prefect.kinetic.detached import submit_detached

        call_args, call_kwargs = self.call_args(args, kwargs)
        return submit_detached(self.task.kinetic, self._body, call_args, call_kwargs, self.task.name, source_fn=self.fn)

    def submit_tagged(self, args: tuple, kwargs: dict[str, Any], tags: tuple[str, ...]) -> Any:
        """``run_async`` of one input of a batch: its job run carries the batch's tags (``run_async_map``)."""
        from kinetic_prefect.kinetic.detached import submit_detached

        call_args, call_kwargs = self.call_args(args, kwargs)
        return submit_detached(
            self.task.kinetic, self._body, call_args, call_kwargs, self.task.name, tags=tags, source_fn=self.fn
        )

    def run_async_map(self, inputs: Any, **options: Any) -> Any:
        """One detached job per input, or inputs riding in slots; a ``BatchHandle`` (kinetic_prefect.kinetic.batch)."""
        from kinetic_prefect.kinetic.batch import run_async_map

        return run_async_map(self, inputs, **options)


def run(
    __fn: Callable[..., Any] | None = None,
    *,
    accelerator: str = KINETIC_DEFAULT_ACCELERATOR,
    capture_env_vars: list[str] | None = None,
    volumes: dict[str, Any] | None = None,
    output_dir: str | None = None,
    spot: bool = False,
    container_image: str | None = None,
    zone: str | None = None,
    project: str | None = None,
    cluster: str | None = None,
    backend: str | None = None,
    namespace: str | None = None,
    base_image_repo: str | None = None,
    debug: bool = False,
    **kinetic_task_options: Any,
) -> Any:
    """Keras Kinetic's ``@kinetic.run``: accelerator names are read as Kinetic reads them (``v5p-8`` is 8 chips on
    2 hosts). Every ``@kinetic_task`` option passes through too (``retries=``, ``requirements=``, ``work_pool=``,
    ``cache_policy=``...): what Prefect adds to Kinetic."""
    translated = _check_kinetic_options(
        {
            "container_image": container_image,
            "zone": zone,
            "project": project,
            "cluster": cluster,
            "backend": backend,
            "namespace": namespace,
            "base_image_repo": base_image_repo,
            "debug": debug,
        }
    )
    options = {**translated, **kinetic_task_options}

    def decorate(fn: Callable[..., Any]) -> RemoteCallable:
        if isinstance(fn, (classmethod, staticmethod)) or not callable(fn):
            raise TypeError(
                f"@kinetic.run decorates a function, not {type(fn).__name__}; put it below @classmethod/@staticmethod"
            )
        return RemoteCallable(fn, accelerator, volumes, output_dir, spot, capture_env_vars, dict(options))

    return decorate(__fn) if __fn is not None else decorate


__all__ = ["RemoteCallable", "run"]
