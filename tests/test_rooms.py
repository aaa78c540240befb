"""Every test module says which room of the package it covers (tests/rooms.py), and its tests carry the room's
marker, so ``pytest -m room_<name>`` runs one room."""

from __future__ import annotations

from pathlib import Path

import pytest
from rooms import ROOM_NAMES, ROOMS, marker_name

pytestmark = pytest.mark.no_server

TESTS = Path(__file__).resolve().parent


def test_every_test_module_names_its_room() -> None:
    modules = {path.name for path in TESTS.glob("test_*.py")}
    unlisted = sorted(modules - set(ROOMS))
    assert not unlisted, "test modules with no room: add each to ROOMS in tests/rooms.py\n" + "\n".join(unlisted)
    gone = sorted(set(ROOMS) - modules)
    assert not gone, "ROOMS in tests/rooms.py names modules that are gone:\n" + "\n".join(gone)


def test_every_room_is_a_known_one() -> None:
    unknown = {module: room for module, room in ROOMS.items() if room not in ROOM_NAMES}
    assert not unknown, f"rooms not in ROOM_NAMES (tests/rooms.py): {unknown}"


def test_the_tests_carry_their_rooms_marker(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker(marker_name("house")) is not None
    assert request.node.get_closest_marker(marker_name("pod")) is None
