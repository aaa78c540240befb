"""Caller side, a call against its pool: the job variables a call sends, and the checks of the call's settings
against the pool's (variables, types, hosts, debug, budget), before anything is uploaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from kinetic_prefect import accelerators, config
from kinetic_prefect.caller import _prefect, budgets, debugging, pools
from kinetic_prefect.caller.calls import KineticOptions, PreparedCall
from kinetic_prefect.contract import Env, checkpoints_key, launchers
from kinetic_prefect.contract.launchers import DebugForwarding, LauncherAbilities
from kinetic_prefect.shared import capacity


def check_abilities(options: KineticOptions, pool: Any, abilities: LauncherAbilities) -> None:
    """Before anything is uploaded: a call that needs what its pool's launcher cannot do (``contract.launchers``)
    is refused, naming the pool, the ability and the pool types that have it. A job variable counts whether the call
    sets it or the pool's template does."""

    def refuse(setting: str, ability: str, has_it: Callable[[LauncherAbilities], bool]) -> None:
        able = pools.types_able(has_it)
        where = f"Drop {setting}, or use a pool of type {' or '.join(map(repr, able))}." if able else f"Drop {setting}."
        raise ValueError(f"{setting}: " + launchers.refusal(pool.name, pool.type, ability, where))

    if options.image and not abilities.runs_images:
        refuse(f"image={options.image!r}", "run container images", lambda a: a.runs_images)
    if options.debug and abilities.debug_forwarding is DebugForwarding.NONE:
        refuse("debug=True", "forward a debugger", lambda a: a.debug_forwarding is not DebugForwarding.NONE)
    hosts = options.job_variables.get("hosts", options.hosts)
    if accelerators.host_count(options.accelerator, hosts) > 1 and not abilities.multi_host:
        refuse(f"hosts={hosts}", "run a group of hosts", lambda a: a.multi_host)
    if not abilities.warm_reuse and (warm := _first_set(options, pool, "keep_warm_seconds", "min_warm")):
        refuse(warm, "keep jobs warm", lambda a: a.warm_reuse)
    if not abilities.spot and (spot := _spot_asked(options, pool)):
        refuse(spot, "run on spot capacity", lambda a: a.spot)
    held = ("reservation", "reservation_project", "flex_start", "queued_provisioning")
    if not abilities.reservations and (reserved := _first_set(options, pool, *held)):
        refuse(reserved, "consume a reservation or queued capacity", lambda a: a.reservations)


def _first_set(options: KineticOptions, pool: Any, *names: str) -> str:
    """The first of the job variables ``names`` the call or else the pool sets to a truthy value, as ``name=value``
    ('' when none is)."""
    for name in names:
        value = options.job_variables.get(name, _prefect.pool_default(pool, name))
        if value:
            return f"{name}={value!r}"
    return ""


def _spot_asked(options: KineticOptions, pool: Any) -> str:
    """What asks the call for spot capacity ('' when nothing does): a spot accelerator, ``spot_fallback=True``, the
    ``spot`` job variable."""
    spot = next((spec for spec in options.accelerator_choices if spec.spot), None)
    if spot is not None:
        return f"accelerator={capacity.label(spot)!r}"
    if options.spot_fallback:
        return "spot_fallback=True"
    return _first_set(options, pool, "spot")


def check_hosts(options: KineticOptions, pool_name: str, pool_type: str, pool_variables: set[str]) -> None:
    """Before anything is uploaded: a group of hosts needs a pool whose job template takes ``hosts`` (a launcher
    that runs groups ships it; a pool created from an older template lacks it and would run one process)."""
    hosts = options.job_variables.get("hosts", options.hosts)
    count = accelerators.host_count(options.accelerator, hosts)
    if hosts is not None and count > 1 and "hosts" not in pool_variables:
        raise ValueError(
            f"hosts={hosts}: pool {pool_name!r} (type {pool_type!r}) cannot run a group of hosts: its base job "
            f"template has no `hosts` variable (made before multi-host groups). Update the template, e.g. "
            f"`prefect work-pool update {pool_name} --base-job-template work_pools/{pool_type}.json`, "
            "or drop hosts= to run on one host."
        )


def build_job_variables(
    options: KineticOptions, call: PreparedCall, store_url: str, pool_variables: set[str]
) -> dict[str, Any]:
    env = {
        Env.RUN_ID: call.layout.run_id,
        Env.RUN_PREFIX: call.layout.prefix,  # the name jobs of kinetic-prefect 0.1 read
        Env.PAYLOAD_SHA256: call.payload_sha256,
        "KERAS_BACKEND": os.environ.get("KERAS_BACKEND", "jax"),
        "JAX_PLATFORMS": options.accelerator.jax_platform,
        # Keyed by the task run, not the job: a retry (a new job) resumes from the same checkpoints.
        Env.CHECKPOINT_KEY: checkpoints_key(call.task_run_id or call.layout.run_id),
    }
    if call.code_archive is not None:
        env[Env.CODE_KEY] = call.code_archive.key
        env[Env.CODE_SHA256] = call.code_archive.sha256
    debug = debugging.job_variables(options, call.project_dir, pool_variables)
    env.update(debug.pop("env", {}))
    spec = debugging.job_image_spec(options, pool_variables)
    variables: dict[str, Any] = {
        **options.job_variables,
        "accelerator": capacity.join(options.accelerator_choices),
        "image_tag": options.image or spec.tag,
        "requirements": list(spec.requirements),
        "python_version": spec.python,
        "base_image": spec.base_image,
        "store": store_url,
        **debug,
    }
    if options.hosts is not None and "hosts" in pool_variables:
        variables["hosts"] = options.hosts
    for name in ("preemption_retries", "spot_fallback"):
        if getattr(options, name) is not None and name in pool_variables:
            variables[name] = getattr(options, name)
    variables["env"] = {**options.job_variables.get("env", {}), **env}
    if options.image and "image" in pool_variables:
        variables["image"] = options.image
    return variables


def check_job_variables(
    pool_name: str, pool_variables: set[str], job_variables: dict[str, Any], variables_model: Any
) -> None:
    """A job variable the pool does not have (a typo, ``keep_warm_secnds``) or a value its type refuses fails here,
    naming it, instead of being ignored by the template or failing in the worker as a raw validation error."""
    import difflib

    from pydantic import TypeAdapter, ValidationError

    fields = getattr(variables_model, "model_fields", {}) or {}
    for name, value in job_variables.items():
        if name not in pool_variables:
            close = difflib.get_close_matches(name, sorted(pool_variables), 1)
            raise ValueError(
                f"job_variables[{name!r}]: pool {pool_name!r} has no variable {name!r}"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + f" Its variables: {', '.join(sorted(pool_variables))}."
            )
        field = fields.get(name)
        if field is None or value is None:
            continue
        try:
            TypeAdapter(field.annotation).validate_python(value)
        except ValidationError as exc:
            problem = exc.errors()[0].get("msg", str(exc))
            raise ValueError(
                f"job_variables[{name!r}]={value!r}: {problem}"
                + (f" ({name}: {field.description})" if field.description else "")
            ) from None


def check_pinned_variables(pool: Any, job_variables: dict[str, Any], variables_model: Any) -> None:
    """A job variable the pool pins (``namespace``, ``command``, ``inherit_env``...: anything but the model's
    ``caller_variables``) set to another value than the pool's, or a worker-only name in ``env``, fails here, naming
    the fix, instead of in the worker, which refuses the run (issue 45, finding 7)."""
    from kinetic_prefect.contract.job_variables import (
        env_refusal,
        override_refusal,
        pinned_overrides,
        reserved_env_names,
        sent_variables,
    )

    allowed = getattr(variables_model, "caller_variables", None)
    if allowed is None:
        return
    sent = sent_variables(job_variables)
    found = pinned_overrides(allowed, sent, pool.base_job_template)
    if found:
        raise ValueError("@kinetic_task(job_variables=...): " + override_refusal(pool.name, allowed, found))
    reserved = reserved_env_names(sent.get("env"))
    if reserved:
        raise ValueError("@kinetic_task(job_variables=...): " + env_refusal(pool.name, reserved))


async def _check_against_pool(client: Any, options: KineticOptions, pool: Any) -> float | None:
    """The call's settings checked against its pool's, before anything is uploaded; the budget it runs under."""
    worker_class = _prefect.worker_class_for(pool.type)
    pool_variables = set(pool.base_job_template["variables"]["properties"])
    variables_model = getattr(worker_class, "job_configuration_variables", None)
    abilities = _prefect.abilities_of(pool.type)
    check_abilities(options, pool, abilities)
    check_job_variables(pool.name, pool_variables, options.job_variables, variables_model)
    check_pinned_variables(pool, options.job_variables, variables_model)
    worker_class.check_pool_settings(
        pool.name,
        {name: _prefect.pool_default(pool, name) for name in pool_variables},
        {  # the call's accelerator, not the pool's default, is what the launcher must be able to run
            **options.job_variables,
            "accelerator": capacity.join(options.accelerator_choices),
            **({"hosts": options.hosts} if options.hosts is not None else {}),
            **({"image": options.image} if options.image else {}),
        },
    )
    check_hosts(options, pool.name, pool.type, pool_variables)
    debugging.check(options, pool.name, pool_variables)
    budget = await budgets.call_budget(client, options.max_cost_usd, pool, pool_variables)
    budgets.check_priced(
        options.accelerator,
        budget,
        pool.name,
        options.job_variables.get("prices", _prefect.pool_default(pool, "prices")),
        options.fallbacks,
        abilities.price_source,
    )
    return budget


async def checked_pool(client: Any, options: KineticOptions) -> tuple[Any, float | None]:
    """The call's pool, checked against the call's options before anything is uploaded, and the call's budget."""
    pool_name = options.work_pool or config.default_work_pool()
    pool = await _prefect.ensure_work_pool(client, pool_name)
    try:
        budget = await _check_against_pool(client, options, pool)
    except (ValueError, LookupError):  # an error that names a pool change is not answered from a stale copy
        pool = await _prefect.ensure_work_pool(client, pool_name, fresh=True)
        budget = await _check_against_pool(client, options, pool)
    if options.image and "image" not in pool.base_job_template["variables"]["properties"]:
        raise ValueError(
            f"image={options.image!r} needs a pool that runs container images; pool {pool.name!r} (type "
            f"{pool.type!r}) has no `image` variable in its base job template. Update it: `prefect work-pool update "
            f"{pool.name} --base-job-template work_pools/{pool.type}.json`"
        )
    return pool, budget
