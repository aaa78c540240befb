"""Kept for user code: the module is ``kinetic_prefect.pod.outputs`` (the same module object)."""

import sys

from kinetic_prefect.pod import outputs as _module

sys.modules[__name__] = _module
