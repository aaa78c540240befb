"""Provisioning, what every launcher's ``kinetic-prefect up`` / ``down`` shares: the step framework and the hook.

A launcher that makes its own infrastructure gives its ``commands`` module a ``provisioning()`` returning a
:class:`Platform`: its ``--platform`` name, its clients, and the plans of ``up`` and ``down`` built from
:class:`Step` s (each resource looked up first; only a step that changes something carries an action, so a second
``up`` makes nothing and one that failed halfway resumes). The CLI finds the platform by that name among the
registered worker classes, shows the plan, asks, and applies it (:func:`apply`); it knows no platform itself.
The signing key's steps are here because every platform's pools sign with the same Prefect Secret block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kinetic_prefect import signing

EXISTS, CREATE, UPDATE, SKIP = "exists", "will create", "will update", "skipped"
DELETE, ABSENT, KEEP = "will delete", "not found", "kept"
SIGNING_KEY_BYTES = 32  # the master key `up` makes: secrets.token_urlsafe of this many random bytes


class ProvisionError(ValueError):
    """Provisioning cannot go on; the message names the culprit and the fix."""


@dataclass
class Step:
    kind: str
    name: str
    state: str
    note: str = ""
    action: Callable[[], None] | None = field(default=None, repr=False)


class StepFailed(ProvisionError):
    def __init__(self, step: Step, error: BaseException, done: list[Step]):
        self.step, self.error, self.done = step, error, done
        super().__init__(f"{step.kind} {step.name}: {type(error).__name__}: {error}")


def apply(steps: list[Step], say: Callable[[str], None]) -> list[Step]:
    """Run each step's action in order; the first failure stops the run (:class:`StepFailed`, with what was done)."""
    done: list[Step] = []
    for step in steps:
        if step.action is None:
            continue
        say(f"{step.kind} {step.name}: {step.state.removeprefix('will ')}...")
        try:
            step.action()
        except Exception as exc:  # noqa: BLE001 - reported with the step it stopped, and what was done before
            raise StepFailed(step, exc, done) from exc
        done.append(step)
    return done


@dataclass(frozen=True)
class Options:
    """``up`` / ``down``'s command-line options; each platform reads those it has and checks them."""

    project: str | None = None
    zone: str | None = None
    region: str | None = None
    cluster: str | None = None
    accelerators: tuple[str, ...] = ()
    spot: bool = False
    reservation: str | None = None
    min_nodes: int = 0
    pool_name: str | None = None
    worker_image: str | None = None
    delete_data: bool = False
    delete_signing_key: bool = False


@dataclass
class Plan:
    """What a command would do: shown as a table, asked about, then applied."""

    title: str
    steps: list[Step]
    question: str
    rerun: str
    next_steps: list[str] = field(default_factory=list)  # printed after an ``up`` that was applied


ClientsFor = Callable[[str], Any]  # project -> the platform's clients (the CLI's, with its console and checks)


class Platform(Protocol):
    """A launcher's provisioning (its ``commands`` module's ``provisioning()``)."""

    name: str  # the value of --platform

    def make_clients(self, project: str) -> Any: ...

    def plan_up(self, options: Options, clients: ClientsFor) -> Plan: ...

    def plan_down(self, options: Options, clients: ClientsFor) -> Plan: ...


class PrefectAccess:
    """A sync Prefect client as a context manager; tests give ``prefect`` a factory of their own."""

    prefect: Callable[[], Any] | None = None

    @contextlib.contextmanager
    def prefect_client(self) -> Iterator[Any]:
        if self.prefect is not None:
            with self.prefect() as client:
                yield client
            return
        from prefect import get_client

        with get_client(sync_client=True) as client:
            yield client


def _signing_key_block(clients: Any) -> Any | None:
    from prefect.exceptions import ObjectNotFound

    with clients.prefect_client() as client:
        try:
            return client.read_block_document_by_name(signing.SECRET_BLOCK, block_type_slug="secret")
        except ObjectNotFound:
            return None


def signing_key_step(clients: Any) -> Step:
    """The store's signing key: a random ``SIGNING_KEY_BYTES``-byte secret saved as the Prefect Secret block
    ``kinetic-signing-key``, which callers and workers read (``shared.key_blocks``), so every call on the pool
    is signed from the first. Made only when absent (never replaced: objects signed with it must still verify), and
    never printed."""
    name = f"Prefect Secret block {signing.SECRET_BLOCK}"
    if _signing_key_block(clients) is not None:
        return Step("signing key", name, EXISTS, "kept as it is")

    def create() -> None:
        import secrets

        from prefect.blocks.system import Secret

        if _signing_key_block(clients) is not None:  # made meanwhile: never replaced
            return
        key: Secret[str] = Secret(value=secrets.token_urlsafe(SIGNING_KEY_BYTES))  # type: ignore[arg-type]
        key.save(name=signing.SECRET_BLOCK, overwrite=False)

    return Step("signing key", name, CREATE, f"random {SIGNING_KEY_BYTES}-byte key, not shown", create)


def delete_signing_key_step(clients: Any, delete: bool) -> Step:
    """``down`` keeps the signing key unless asked: stored results and checkpoints signed with it verify only with
    it, and another platform's pools may share it."""
    name = f"Prefect Secret block {signing.SECRET_BLOCK}"
    block = _signing_key_block(clients)
    if block is None:
        return Step("signing key", name, ABSENT)
    if not delete:
        return Step("signing key", name, KEEP, "--delete-signing-key deletes it")

    def remove() -> None:
        with clients.prefect_client() as client:
            client.delete_block_document(block.id)

    return Step("signing key", name, DELETE, "objects signed with it can no longer be verified", remove)


__all__ = [
    "ABSENT",
    "CREATE",
    "DELETE",
    "EXISTS",
    "KEEP",
    "SKIP",
    "UPDATE",
    "Options",
    "Plan",
    "Platform",
    "PrefectAccess",
    "ProvisionError",
    "Step",
    "StepFailed",
    "apply",
    "delete_signing_key_step",
    "signing_key_step",
]
