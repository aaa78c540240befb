"""A project module with state of its own: a warm runner imports it afresh for every call it takes."""

CALLS: list[int] = []
