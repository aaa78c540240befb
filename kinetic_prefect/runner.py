"""Kept for images and scripts that run ``python -m kinetic_prefect.runner``: the runner is
``kinetic_prefect.pod.runner`` (``contract.RUNNER_ARGV``); importing this path gives that module."""

import sys

from kinetic_prefect.pod import runner as _module

if __name__ == "__main__":
    _module.exit_process(_module.main())  # as the runner's own ``__main__`` ends (flushing, exit code)
else:
    sys.modules[__name__] = _module
