"""A project module that kinetic jobs in the tests import (shipped with the project code)."""


def triangle(n: int) -> list[int]:
    return [k * (k + 1) // 2 for k in range(1, n + 1)]
