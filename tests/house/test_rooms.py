"""Every test module says which room of the package it covers (tests/support/rooms.py), and its tests carry the room's
marker, so ``pytest -m room_<name>`` runs one room."""

from __future__ import annotations

from pathlib import Path

import pytest
from rooms import FOLDERS, ROOM_NAMES, ROOMS, marker_name

pytestmark = pytest.mark.no_server

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_names_its_room() -> None:
    paths = sorted(TESTS.glob("**/test_*.py"))
    modules = {path.name for path in paths}
    assert len(modules) == len(paths), "two test modules share a name (they are imported by name): rename one"
    unlisted = sorted(modules - set(ROOMS))
    assert not unlisted, "test modules with no room: add each to ROOMS in tests/support/rooms.py\n" + "\n".join(
        unlisted
    )
    gone = sorted(set(ROOMS) - modules)
    assert not gone, "ROOMS in tests/support/rooms.py names modules that are gone:\n" + "\n".join(gone)


def test_every_test_module_lives_in_its_rooms_folder() -> None:
    misplaced = [
        f"{path.relative_to(TESTS)} (room {ROOMS[path.name]}: tests/{FOLDERS[ROOMS[path.name]]}/)"
        for path in sorted(TESTS.glob("**/test_*.py"))
        if path.name in ROOMS and path.parent != TESTS / FOLDERS[ROOMS[path.name]]
    ]
    assert not misplaced, "test modules outside their room's folder: move them\n" + "\n".join(misplaced)


def test_helpers_live_in_support() -> None:
    strays = [
        str(path.relative_to(TESTS))
        for path in sorted(TESTS.glob("**/*.py"))
        if not path.name.startswith(("test_", "bench_", "conftest"))
        and path.parent.name not in {"support", "kinetic_examples"}
        and "support" not in path.relative_to(TESTS).parts
    ]
    assert not strays, "helper modules outside tests/support/: move them there\n" + "\n".join(strays)


def test_every_room_is_a_known_one() -> None:
    unknown = {module: room for module, room in ROOMS.items() if room not in ROOM_NAMES}
    assert not unknown, f"rooms not in ROOM_NAMES (tests/support/rooms.py): {unknown}"


def test_the_tests_carry_their_rooms_marker(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker(marker_name("house")) is not None
    assert request.node.get_closest_marker(marker_name("pod")) is None
