"""Caller side: the kinetic options of a task, declared once (``TaskOptions``): their defaults, what each means, and
the checks they pass. ``@kinetic_task`` (its keywords are these fields, for the reader and the IDE; a test holds
the two equal), ``kinetic.run`` (through ``kinetic_task``) and ``KineticTask.with_options`` all read this model, and
``TaskOptions.resolve`` turns it into the call's ``KineticOptions`` in one step: the accelerator resolved once into
its ``AcceleratorSpec`` and fallbacks (carried as specs to the job variables), the environment's ``ImageSpec``, the
budget checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kinetic_prefect import accelerator_names as names
from kinetic_prefect import accelerators
from kinetic_prefect.caller.env_capture import check_entries
from kinetic_prefect.shared import capacity
from kinetic_prefect.shared.image import ImageSpec

AcceleratorChoice = str | accelerators.AcceleratorSpec | Sequence[str | accelerators.AcceleratorSpec]
SUBMISSION_MODES = ("auto", "in-process", "worker")


@dataclass(frozen=True)
class KineticOptions:
    """A task's options as its calls read them (``TaskOptions.resolve`` makes them): the accelerator and its
    fallbacks as specs, the environment as an ``ImageSpec``; the rest as given."""

    accelerator: accelerators.AcceleratorSpec
    image_spec: ImageSpec
    image: str | None = None
    work_pool: str | None = None
    env: tuple[str, ...] = ()
    env_missing: str = "error"  # an unset exact name in `env`: "error" fails the call, "warn" leaves it out
    submission: str = "auto"
    project_dir: Path | None = None
    ship_project: bool = True
    job_variables: dict[str, Any] = field(default_factory=dict)
    hosts: int | None = None  # a group of N hosts (one jax.distributed group); None: the accelerator's own
    max_cost_usd: float | None = None  # the worker stops the job when its metered cost reaches it
    fallbacks: tuple[accelerators.AcceleratorSpec, ...] = ()  # tried in order after `accelerator` (capacity.py)
    preemption_retries: int | None = None  # None: the pool's
    spot_fallback: bool | None = None  # None: the pool's
    debug: bool = False  # the job waits for a debugger before the function runs (caller/debugging.py)
    given: TaskOptions | None = None  # what the decorator was given: with_options changes it and resolves again
    # Entries of the fallback list that name another pool ("POOL/NAME"): (pool, its accelerators), in order, tried
    # when the pools before could not place the job (caller/submission.py); empty: one pool
    pool_fallbacks: tuple[tuple[str, tuple[accelerators.AcceleratorSpec, ...]], ...] = ()

    def on_next_pool(self) -> KineticOptions:
        """These options on the first pool of ``pool_fallbacks``, with its accelerators."""
        (pool, (spec, *rest)), *later = self.pool_fallbacks
        return dataclasses.replace(
            self, work_pool=pool, accelerator=spec, fallbacks=tuple(rest), pool_fallbacks=tuple(later)
        )

    @property
    def accelerator_choices(self) -> tuple[accelerators.AcceleratorSpec, ...]:
        """The accelerator, then its fallbacks, in the order they are tried."""
        return (self.accelerator, *self.fallbacks)


@dataclass(frozen=True)
class TaskOptions:
    """Where and how a kinetic task's body runs, as ``@kinetic_task(...)`` takes it. Every other keyword of
    ``kinetic_task`` is a Prefect task option (``retries``, ``cache_policy``, ``tags``...).

    :param accelerator: A catalog name (``cpu``, ``l4``, ``a100x2``, ``tpu-v6e-8``, ``l4:spot``...), or a fallback list
            tried in order (``["tpu-v6e-8", "a100x4", "l4x4"]``): on GKE the next is tried when the cluster cannot place
            the job, never once it started (docs/capacity.md); locally the first this machine has. An entry
            ``"POOL/NAME"`` names another pool (``["l4:spot", "vertex/l4"]``): when the pools before it have no
            capacity for the job (their run ends Crashed before the job ran), the call runs there (docs/vertex.md).
    :param requirements: A requirements.txt / pyproject.toml path or a list of PEP 508 strings; the job environment is
            built once per distinct set. ``None``: the worker's interpreter.
    :param image: A prebuilt container image (skips building; GKE).
    :param work_pool: The Prefect work pool (default ``$KINETIC_WORK_POOL`` or ``kinetic-local``).
    :param env: Names or glob patterns of the caller's environment variables to forward to the job; a pattern never
            matches the caller's own process configuration (``PATH``, ``HOME``, ``LD_*``, ``PYTHON*``, ``VIRTUAL_ENV``,
            ``KERAS_BACKEND``, ``KINETIC_*``, ``PREFECT_*``...), an exact name always forwards.
    :param env_missing: An exact name in ``env`` that is not set: ``"error"`` fails the call before anything is
            uploaded, ``"warn"`` leaves it out with a warning (Kinetic's ``capture_env_vars`` rule).
    :param submission: ``auto`` (a polling worker if one is online, else in-process), ``in-process`` or ``worker``.
    :param project_dir: The directory shipped with the job (default: the project containing the function).
    :param ship_project: Set False to ship only the pickled function.
    :param job_variables: Extra job variables for the pool's template.
    :param base_image: Base of the built image (GKE), part of the environment's hash.
    :param hosts: Run the body on N hosts as one ``jax.distributed`` group (the runner joins it before the body;
            ``jax.process_count() == N``); the coordinator's (host 0's) return value is the result, every host's outputs
            are kept (``outputs/<run>/hosts/<i>/``), one failed host fails the call. Default: the accelerator's own
            hosts (a multi-host TPU slice such as ``tpu-v5litepod-16`` is 4), else 1. On kinetic-local, N local
            processes (on the CPU when the machine lacks the accelerator).
    :param max_cost_usd: A budget per call in US dollars: the worker stops the job when its metered cost (hosts x
            minutes x the pool's price) reaches it; the call raises ``BudgetExceeded`` (not retried) and the job's
            checkpoints and outputs are kept. Default: the pool's ``max_cost_usd``, if any.
    :param preemption_retries: How often a preempted job (spot reclaimed, node lost) starts again under the same run,
            resuming from its checkpoints, without spending ``retries`` (default: the pool's, 3).
    :param spot_fallback: For a spot job, run the last preemption retry on on-demand capacity (GKE).
    :param debug: The job starts debugpy and waits for a debugger (``KINETIC_DEBUG_WAIT_SECONDS``, default 600) before
            the function runs; ``kinetic-prefect jobs debug JOB --port 5678`` attaches (docs/debugging.md).
    """

    accelerator: AcceleratorChoice = "cpu"
    requirements: str | Path | Sequence[str] | None = None
    image: str | None = None
    work_pool: str | None = None
    env: Iterable[str] = ()
    env_missing: str = "error"
    submission: str = "auto"
    project_dir: str | Path | None = None
    ship_project: bool = True
    job_variables: dict[str, Any] | None = None
    base_image: str | None = None
    hosts: int | None = None
    max_cost_usd: float | None = None
    preemption_retries: int | None = None
    spot_fallback: bool | None = None
    debug: bool = False

    def replace(self, **changes: Any) -> TaskOptions:
        """These options with ``changes`` (``with_options``)."""
        return dataclasses.replace(self, **changes)

    def resolve(self) -> KineticOptions:
        """The call's options: every check made, the accelerator resolved once. Fails at decoration on unknown
        names, a yes/no option that is not a bool (``debug="false"``), ``hosts=0``, hosts contradicting a slice, a
        list mixing host counts, a bad budget, an unknown ``submission``/``env_missing``, a negative
        ``preemption_retries`` or a missing ``project_dir``."""
        for option in dataclasses.fields(self):
            if "bool" in str(option.type):
                check_yes_no(option.name, getattr(self, option.name), optional="None" in str(option.type))
        pools = _pool_segments(self.accelerator, self.work_pool)
        spec, *fallbacks = capacity.choices(list(pools[0][1]), self.hosts)
        later = tuple((pool, tuple(capacity.choices(list(entries), self.hosts))) for pool, entries in pools[1:])
        for _, entries in pools:
            for name in entries:
                names.warn_if_read_differently(name)  # once per name: Keras Kinetic reads it as other hardware
        from kinetic_prefect.shared.cost import check_budget

        resolved: dict[str, Any] = {
            "accelerator": spec,
            "fallbacks": tuple(fallbacks),
            "max_cost_usd": check_budget(self.max_cost_usd),  # max_cost_usd=0 or "5" fails here too
            "image_spec": ImageSpec.create(self.requirements, family=spec.family, base_image=self.base_image),
            "env": (self.env,) if isinstance(self.env, str) else tuple(self.env),
            "project_dir": Path(self.project_dir) if self.project_dir else None,
            "job_variables": dict(self.job_variables or {}),
            "debug": self.debug,
            "pool_fallbacks": later,
            "work_pool": pools[0][0],
        }
        self._check(resolved["env"])
        as_given = {name: getattr(self, name) for name in _CARRIED if name not in resolved}
        return KineticOptions(**resolved, **as_given, given=self)

    def _check(self, env: tuple[str, ...]) -> None:
        retries = self.preemption_retries
        if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int) or retries < 0):
            raise ValueError(
                f"preemption_retries={retries!r}: give a whole number >= 0 (0: a "
                "preemption crashes the run and the task's `retries` decide)"
            )
        check_entries(env, self.env_missing)
        if self.submission not in SUBMISSION_MODES:
            raise ValueError(f"submission={self.submission!r} is not one of {', '.join(SUBMISSION_MODES)}")
        if self.project_dir is not None and not Path(self.project_dir).is_dir():
            raise ValueError(f"project_dir={str(self.project_dir)!r} is not a directory")


_SAID_FALSE = {"false", "no", "off", "0", ""}
_SAID_TRUE = {"true", "yes", "on", "1"}


def check_yes_no(name: str, value: Any, optional: bool = False) -> None:
    """A yes/no option is a bool (or None where ``optional``: the pool decides). Anything else is refused, naming
    the fix: read by truthiness, ``debug="false"`` would turn debugging on."""
    if isinstance(value, bool) or (optional and value is None):
        return
    said = str(value).strip().lower()
    meant = "False" if said in _SAID_FALSE else "True" if said in _SAID_TRUE else None
    fix = f"write {name}={meant}" if meant else f"write {name}=True or {name}=False"
    raise ValueError(
        f"{name}={value!r}: a yes/no option takes True or False"
        + (" (or None: the pool's setting)" if optional else "")
        + f", not {type(value).__name__} (a value read by truthiness would mean yes for 'false'); {fix}"
    )


def _pool_segments(
    accelerator: AcceleratorChoice, work_pool: str | None
) -> list[tuple[str | None, list[str | accelerators.AcceleratorSpec]]]:
    """The fallback list cut where an entry names another pool (``"POOL/NAME"``): (pool, its entries) in order, the
    first on ``work_pool`` unless its first entry names one. One pool: one segment, the list as it is."""
    if isinstance(accelerator, (str, accelerators.AcceleratorSpec)):
        items: list[Any] = capacity.split(accelerator) if isinstance(accelerator, str) else [accelerator]
    else:
        items = list(accelerator)
    segments: list[tuple[str | None, list[Any]]] = []
    for item in items:
        pool, _, name = item.rpartition("/") if isinstance(item, str) else ("", "", item)
        named: str | None = pool.strip() or (segments[-1][0] if segments else work_pool)
        if not segments or named != segments[-1][0]:
            segments.append((named, []))
        segments[-1][1].append(name.strip() if isinstance(name, str) else name)
    return segments or [(work_pool, items)]


# The options that are kinetic's, not Prefect's.
OPTION_NAMES = tuple(option.name for option in dataclasses.fields(TaskOptions))
# The options KineticOptions carries under the same name (as given, unless resolve makes them).
_CARRIED = tuple(name for name in OPTION_NAMES if name in {f.name for f in dataclasses.fields(KineticOptions)})


def given(keywords: dict[str, Any]) -> TaskOptions:
    """The ``TaskOptions`` among a function's keywords (``kinetic_task``'s own, read from its ``locals()``)."""
    return TaskOptions(**{name: keywords[name] for name in OPTION_NAMES})


__all__ = ["OPTION_NAMES", "KineticOptions", "TaskOptions", "check_yes_no", "given"]
