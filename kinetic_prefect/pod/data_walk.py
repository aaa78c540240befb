"""Finding and replacing objects inside a call's arguments, wherever they are nested.

The caller puts a ``DataRef`` in place of each :class:`~kinetic_prefect.pod.data.Data` before the arguments are
pickled; the job puts a local path in place of each ``DataRef``. The walk goes through lists, tuples
(namedtuples too), dict values, sets, frozensets and dataclass instances; a container that holds no match is
kept as it is (the same object), an object met twice is walked once, and a cycle's inner reference is left as
it is.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, Path)


def _walker(
    fn: Callable[[Any], Any] | None, match: type | tuple[type, ...], found: list[Any] | None
) -> Callable[[Any], Any]:
    memo: dict[int, Any] = {}
    active: set[int] = set()
    keep: list[Any] = []  # keeps walked objects alive, so their ids are not reused during the walk

    def visit(obj: Any) -> Any:
        if isinstance(obj, match):
            oid = id(obj)
            if oid in memo:
                return memo[oid]
            if found is not None:
                found.append(obj)
            new = fn(obj) if fn is not None else obj
            memo[oid] = new
            keep.append(obj)
            return new
        if isinstance(obj, (_ATOMS, type)):
            return obj
        oid = id(obj)
        if oid in memo:
            return memo[oid]
        if oid in active:  # a cycle: leave the inner reference as it is
            return obj
        active.add(oid)
        try:
            new = _rebuild(obj, visit)
        finally:
            active.discard(oid)
        memo[oid] = new
        keep.append(obj)
        return new

    return visit


def _rebuild(obj: Any, visit: Callable[[Any], Any]) -> Any:
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
        new_items = [visit(item) for item in items]
        if all(a is b for a, b in zip(items, new_items)):
            return obj
        cls = type(obj)
        if cls in (list, tuple, set, frozenset):
            return cls(new_items)
        if isinstance(obj, tuple):
            if hasattr(cls, "_make"):  # namedtuple
                return cls._make(new_items)
            return cls(new_items)
        new: Any = copy.copy(obj)  # list/set subclasses: keep the class and its attributes
        if isinstance(obj, list):
            new[:] = new_items
            return new
        if isinstance(obj, set):
            new.clear()
            new.update(new_items)
            return new
        return cls(new_items)
    if isinstance(obj, dict):
        changed = {}
        for key, value in obj.items():
            new_value = visit(value)
            if new_value is not value:
                changed[key] = new_value
        if not changed:
            return obj
        new = dict(obj) if type(obj) is dict else copy.copy(obj)  # OrderedDict, defaultdict, Counter keep type
        new.update(changed)
        return new
    if dataclasses.is_dataclass(obj):
        changed = {}
        for field in dataclasses.fields(obj):
            try:
                value = getattr(obj, field.name)
            except AttributeError:  # an init=False field never set
                continue
            new_value = visit(value)
            if new_value is not value:
                changed[field.name] = new_value
        if not changed:
            return obj
        # A shallow copy plus setattr rather than dataclasses.replace(): works for frozen classes and init=False
        # fields, and does not run __post_init__ again (which may insist on the type that was just replaced).
        new = copy.copy(obj)
        for name, value in changed.items():
            object.__setattr__(new, name, value)
        return new
    return obj


def transform(obj: Any, fn: Callable[[Any], Any], match: type | tuple[type, ...]) -> Any:
    """``obj`` with every instance of ``match`` replaced by ``fn(instance)``, through lists, tuples (namedtuples
    too), dict values, sets, frozensets and dataclass instances. Containers that hold no match are returned as they
    are (same identity); other objects are left alone. ``fn`` is called once per distinct instance."""
    return _walker(fn, match, None)(obj)


def find(obj: Any, match: type | tuple[type, ...]) -> list[Any]:
    """Every distinct instance of ``match`` inside ``obj`` (the walk of :func:`transform`), in the order met."""
    found: list[Any] = []
    _walker(None, match, found)(obj)
    return found
