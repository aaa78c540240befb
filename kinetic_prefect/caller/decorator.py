"""Caller side: ``@kinetic_task`` — a real Prefect task whose body runs as a job on an accelerator."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

from prefect import Task

from kinetic_prefect import accelerators
from kinetic_prefect.caller import _prefect, options
from kinetic_prefect.caller.options import KineticOptions
from kinetic_prefect.caller.submission import call_remotely, call_remotely_async
from kinetic_prefect.caller.task_calls import checked_call, remote_body

F = TypeVar("F", bound=Callable[..., Any])


def _remote_body(fn: Callable[..., Any], kinetic: KineticOptions, task_name: str) -> Callable[..., Any]:
    """The Task's fn: same signature and source identity as ``fn`` (so Prefect binds parameters and
    TASK_SOURCE cache keys follow the user's code), but calling it launches a job; an ``async def`` fn
    gets an async body (task_calls.remote_body)."""
    run_as_job = remote_body(
        fn,
        lambda args, kwargs: call_remotely(kinetic, fn, args, kwargs, task_name),
        lambda args, kwargs: call_remotely_async(kinetic, fn, args, kwargs, task_name),
    )
    run_as_job.__kinetic_options__ = kinetic  # type: ignore[attr-defined]
    return run_as_job


def _no_retry_for_deterministic_failures(user_condition: Callable[..., Any] | None) -> Callable[..., Any]:
    """Prefect's ``retry_condition_fn``: a return value that cannot be pickled, a full store, a key mismatch, a
    budget reached or a fallback pool that cannot run its entry fails the same way on every attempt, so it is not
    retried; otherwise the user's own condition (if any) decides."""

    def should_retry(task: Any, task_run: Any, state: Any) -> Any:
        from kinetic_prefect.errors import (
            BudgetExceeded,
            FallbackPoolRefused,
            ResultNotPicklable,
            SigningKeyMismatch,
            StoreFull,
        )

        deterministic = (ResultNotPicklable, StoreFull, SigningKeyMismatch, BudgetExceeded, FallbackPoolRefused)
        if isinstance(getattr(state, "data", None), deterministic):
            return False
        return True if user_condition is None else user_condition(task, task_run, state)

    should_retry.__kinetic_user_condition__ = user_condition  # type: ignore[attr-defined]
    return should_retry


def _check_job_name(name: str, fn: Callable[..., Any]) -> None:
    """The job's run is a Prefect flow named after the task, and Prefect refuses some characters in flow names
    (with an HTTP 422 at the first call): name the culprit and the fix at decoration, before anything is created."""
    from prefect.types.names import BANNED_CHARACTERS

    banned = sorted({ch for ch in name if ch in BANNED_CHARACTERS})
    if not banned:
        return
    code = getattr(fn, "__code__", None)
    where = f" (defined at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    if name == "<lambda>":
        raise ValueError(
            f"kinetic_task cannot name the job of a lambda{where}: its run is a Prefect flow named after "
            "the task, and '<lambda>' is not a valid flow name. Pass name=, e.g. "
            "kinetic_task(name='double')(lambda x: x * 2), or use a def"
        )
    raise ValueError(
        f"kinetic_task name={name!r}{where}: the job's run is a Prefect flow named after the task, and "
        f"flow names cannot contain {' '.join(repr(ch) for ch in banned)}; choose another name="
    )


def _check_task_options(fn: Callable[..., Any], options: dict[str, Any]) -> None:
    """What Prefect accepts at decoration and fails on at every call: refused now, naming the option or function."""

    timeout = options.get("timeout_seconds")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
        raise ValueError(f"kinetic_task timeout_seconds={timeout!r}: give a number of seconds above 0 (or None)")
    retries = options.get("retries")
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
        raise ValueError(f"kinetic_task retries={retries!r}: give a whole number, 0 or more (or None)")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        kind = "an async generator" if inspect.isasyncgenfunction(fn) else "a generator"
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(
            f"kinetic_task cannot run {name}(): it is {kind} function (it yields), and a generator cannot be sent "
            "back from the job; return a list instead"
        )


def _isolated(cache_policy: Any) -> Any:
    """Identical concurrent calls of a cached kinetic task run one job: a SERIALIZABLE policy with a
    lock in the artifact store (kinetic_prefect.caller.locks), so the other callers wait and get the cached
    result, on one machine or many sharing a gs:// store. A policy that already says how it isolates
    is left as it is."""
    from prefect.cache_policies import NO_CACHE, CachePolicy

    if (
        not isinstance(cache_policy, CachePolicy)
        or cache_policy is NO_CACHE
        or cache_policy.isolation_level is not None
    ):
        return cache_policy
    from kinetic_prefect import config
    from kinetic_prefect.caller.locks import StoreLockManager

    return cache_policy.configure(
        isolation_level="SERIALIZABLE", lock_manager=StoreLockManager(config.default_store_url())
    )


# The options that are kinetic's, not Prefect's: TaskOptions' fields (kinetic_task repeats them for the reader and
# the IDE, and a test holds the two signatures equal).
KINETIC_OPTION_NAMES = options.OPTION_NAMES


class KineticTask(Task):
    """A Prefect ``Task`` whose body runs remotely; ``with_options`` also takes the kinetic options."""

    kinetic: KineticOptions
    user_fn: Callable[..., Any]
    results_follow_pool: bool = True  # False once the user passed result_storage=

    def _bind_pool_results(self) -> None:
        """Point Prefect's result storage at the store of the pool this task runs on (kinetic_prefect.caller.results),
        now: Prefect reads it when the task run starts, to look up the cache, before the body runs.

        A pool that cannot be read, or whose GCP settings do not work, leaves Prefect's default here: the
        call then fails inside its task run, where every pool setting is checked before anything is uploaded.
        """
        if not self.results_follow_pool:
            return
        from prefect.utilities.asyncutils import run_coro_as_sync

        from kinetic_prefect import config
        from kinetic_prefect.caller import results
        from kinetic_prefect.shared import gcp

        try:
            self.result_storage = run_coro_as_sync(
                results.for_pool(self.kinetic.work_pool or config.default_work_pool())
            )
        except (_prefect.WorkPoolError, gcp.GcpSettingError):
            self.result_storage = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._bind_pool_results()
        return checked_call(super().__call__(*args, **kwargs), bool(kwargs.get("return_state")))

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        self._bind_pool_results()
        return super().submit(*args, **kwargs)

    def map(self, *args: Any, **kwargs: Any) -> Any:
        self._bind_pool_results()
        return super().map(*args, **kwargs)

    def apply_async(self, *args: Any, **kwargs: Any) -> Any:
        self._bind_pool_results()
        return super().apply_async(*args, **kwargs)

    def with_options(self, **prefect_options: Any) -> KineticTask:
        kinetic_changes = {k: prefect_options.pop(k) for k in list(prefect_options) if k in KINETIC_OPTION_NAMES}
        if "cache_policy" in prefect_options:
            prefect_options["cache_policy"] = _isolated(prefect_options["cache_policy"])
        if prefect_options.get("retry_condition_fn") is not None:
            prefect_options["retry_condition_fn"] = _no_retry_for_deterministic_failures(
                prefect_options["retry_condition_fn"]
            )
        if prefect_options.get("name") is not None:
            _check_job_name(prefect_options["name"], self.user_fn)
        _check_task_options(self.user_fn, prefect_options)
        new: Any = super().with_options(**prefect_options)
        results_follow_pool = self.results_follow_pool and prefect_options.get("result_storage") is None
        kinetic = self.kinetic
        if kinetic_changes:
            if kinetic.given is None:  # options made by hand, not by kinetic_task: nothing to change them from
                raise TypeError("with_options changes the kinetic options of a task made by kinetic_task")
            kinetic = kinetic.given.replace(**kinetic_changes).resolve()
        # Prefect's with_options builds a plain Task around the same fn; give it ours back.
        new.__class__ = KineticTask
        new.kinetic = kinetic
        new.user_fn = self.user_fn
        new.results_follow_pool = results_follow_pool
        new.fn = _remote_body(self.user_fn, kinetic, new.name)
        return new


def _check_decoration(fn: Callable[..., Any], task_options: dict[str, Any]) -> None:
    """What decorating checks at once, before anything is created: the job's name and the task's options."""
    _check_job_name(task_options.get("name") or fn.__name__, fn)
    _check_task_options(fn, task_options)


@overload
def kinetic_task(__fn: F) -> KineticTask: ...
@overload
def kinetic_task(**kwargs: Any) -> Callable[[F], KineticTask]: ...


def kinetic_task(
    __fn: Callable[..., Any] | None = None,
    *,
    accelerator: str | accelerators.AcceleratorSpec | Sequence[str | accelerators.AcceleratorSpec] = "cpu",
    requirements: str | Path | Sequence[str] | None = None,
    image: str | None = None,
    work_pool: str | None = None,
    env: Iterable[str] = (),
    env_missing: str = "error",
    submission: str = "auto",
    project_dir: str | Path | None = None,
    ship_project: bool = True,
    job_variables: dict[str, Any] | None = None,
    base_image: str | None = None,
    hosts: int | None = None,
    max_cost_usd: float | None = None,
    preemption_retries: int | None = None,
    spot_fallback: bool | None = None,
    debug: bool = False,
    **task_options: Any,
):
    """Decorate a function so that each call runs its body as a job on ``accelerator``.

    The kinetic options (where and how the body runs: ``accelerator``, ``requirements``, ``hosts``...) are the
    fields of ``TaskOptions`` (``kinetic_prefect.caller.options``), each documented there with its default.

    Every other keyword is a Prefect task option (``retries``, ``cache_policy``, ``tags``...).
    """
    given = options.given(locals())  # this function's own keywords are TaskOptions' fields

    def decorate(fn: Callable[..., Any]) -> KineticTask:
        _check_decoration(fn, task_options)
        kinetic = given.resolve()
        _prefect.prepare_embedded_server()  # Prefect's longer start-up limit; starts nothing (issue 48, 8)
        name = task_options.pop("name", None) or fn.__name__
        tags = set(task_options.pop("tags", None) or ())
        tags.add(f"accelerator:{kinetic.accelerator.name}")
        task_options["retry_condition_fn"] = _no_retry_for_deterministic_failures(
            task_options.get("retry_condition_fn")
        )
        if "cache_policy" in task_options:
            task_options["cache_policy"] = _isolated(task_options["cache_policy"])
        task = KineticTask(fn=_remote_body(fn, kinetic, name), name=name, tags=tags, **task_options)
        task.kinetic = kinetic
        task.user_fn = fn
        task.results_follow_pool = task.result_storage is None
        return task

    if __fn is not None:
        return decorate(__fn)
    return decorate


__all__ = ["KineticTask", "kinetic_task"]
