"""Kept for user code: the module is ``kinetic_prefect.pod.data`` (the same module object)."""

import sys

from kinetic_prefect.pod import data as _module

sys.modules[__name__] = _module
