"""Caller side: ``@kinetic_task`` — a real Prefect task whose body runs as a job on an accelerator."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar, overload

from prefect import Task

from kinetic_prefect import _prefect, accelerators
from kinetic_prefect.dispatch import KineticOptions, call_remotely
from kinetic_prefect.image import ImageSpec

F = TypeVar("F", bound=Callable[..., Any])

KINETIC_OPTION_NAMES = ("accelerator", "requirements", "image", "work_pool", "env", "submission", "project_dir",
                        "ship_project", "job_variables", "base_image")


def _remote_body(fn: Callable[..., Any], options: KineticOptions, task_name: str) -> Callable[..., Any]:
    """The Task's fn: same signature and source identity as ``fn`` (so Prefect binds parameters and
    TASK_SOURCE cache keys follow the user's code), but calling it launches a job."""

    @functools.wraps(fn)
    def run_as_job(*args: Any, **kwargs: Any) -> Any:
        return call_remotely(options, fn, args, kwargs, task_name)

    run_as_job.__kinetic_options__ = options  # type: ignore[attr-defined]
    return run_as_job


def _options(
    accelerator: str | accelerators.AcceleratorSpec = "cpu",
    requirements: str | Path | Sequence[str] | None = None,
    image: str | None = None,
    work_pool: str | None = None,
    env: Iterable[str] = (),
    submission: str = "auto",
    project_dir: str | Path | None = None,
    ship_project: bool = True,
    job_variables: dict[str, Any] | None = None,
    base_image: str | None = None,
) -> KineticOptions:
    spec = accelerators.resolve(accelerator)  # unknown names fail here, at decoration time
    if isinstance(env, str):
        env = (env,)
    return KineticOptions(
        accelerator=spec,
        image_spec=ImageSpec.create(requirements, family=spec.family, base_image=base_image),
        image=image,
        work_pool=work_pool,
        env=tuple(env),
        submission=submission,
        project_dir=Path(project_dir) if project_dir else None,
        ship_project=ship_project,
        job_variables=dict(job_variables or {}),
    )


class KineticTask(Task):
    """A Prefect ``Task`` whose body runs remotely; ``with_options`` also takes the kinetic options."""

    kinetic: KineticOptions
    user_fn: Callable[..., Any]

    def with_options(self, **options: Any) -> "KineticTask":  # type: ignore[override]
        kinetic_changes = {k: options.pop(k) for k in list(options) if k in KINETIC_OPTION_NAMES}
        new = super().with_options(**options)
        kinetic = self.kinetic
        if kinetic_changes:
            current = {
                "accelerator": kinetic.accelerator, "requirements": list(kinetic.image_spec.requirements) or None,
                "image": kinetic.image, "work_pool": kinetic.work_pool, "env": kinetic.env,
                "submission": kinetic.submission, "project_dir": kinetic.project_dir,
                "ship_project": kinetic.ship_project, "job_variables": kinetic.job_variables,
                "base_image": kinetic.image_spec.base_image,
            }
            kinetic = _options(**{**current, **kinetic_changes})
        # Prefect's with_options builds a plain Task around the same fn; give it ours back.
        new.__class__ = KineticTask
        new.kinetic = kinetic
        new.user_fn = self.user_fn
        new.fn = _remote_body(self.user_fn, kinetic, new.name)
        return new


@overload
def kinetic_task(__fn: F) -> KineticTask: ...
@overload
def kinetic_task(**kwargs: Any) -> Callable[[F], KineticTask]: ...


def kinetic_task(
    __fn: Callable[..., Any] | None = None,
    *,
    accelerator: str | accelerators.AcceleratorSpec = "cpu",
    requirements: str | Path | Sequence[str] | None = None,
    image: str | None = None,
    work_pool: str | None = None,
    env: Iterable[str] = (),
    submission: str = "auto",
    project_dir: str | Path | None = None,
    ship_project: bool = True,
    job_variables: dict[str, Any] | None = None,
    base_image: str | None = None,
    **task_options: Any,
):
    """Decorate a function so that each call runs its body as a job on ``accelerator``.

    Kinetic options:
        accelerator: a catalog name (``cpu``, ``l4``, ``a100x2``, ``tpu-v6e-8``, ``l4:spot``...).
        requirements: a requirements.txt / pyproject.toml path or a list of PEP 508 strings; the job
            environment is built once per distinct set. ``None``: the worker's interpreter.
        image: a prebuilt container image (skips building; GKE).
        work_pool: the Prefect work pool (default ``$KINETIC_WORK_POOL`` or ``kinetic-local``).
        env: names or glob patterns of the caller's environment variables to forward to the job.
        submission: ``auto`` (a polling worker if one is online, else in-process), ``in-process`` or ``worker``.
        project_dir: the directory shipped with the job (default: the project containing the function).
        ship_project: set False to ship only the pickled function.
        job_variables: extra job variables for the pool's template.
        base_image: base of the built image (GKE), part of the environment's hash.

    Every other keyword is a Prefect task option (``retries``, ``cache_policy``, ``tags``...).
    """

    def decorate(fn: Callable[..., Any]) -> KineticTask:
        options = _options(accelerator, requirements, image, work_pool, env, submission, project_dir,
                           ship_project, job_variables, base_image)
        name = task_options.pop("name", None) or fn.__name__
        tags = set(task_options.pop("tags", None) or ())
        tags.add(f"accelerator:{options.accelerator.name}")
        shared_results = None
        if "result_storage" not in task_options:
            from kinetic_prefect.results import result_storage

            shared_results = result_storage()  # a gs:// KINETIC_STORE: results live beside the rest
        task = KineticTask(fn=_remote_body(fn, options, name), name=name, tags=tags, **task_options)
        task.kinetic = options
        task.user_fn = fn
        if shared_results is not None:
            _prefect.attach_result_storage(task, shared_results)
        return task

    if __fn is not None:
        return decorate(__fn)
    return decorate


__all__ = ["KineticTask", "kinetic_task"]
