"""``python -m kinetic_prefect.cli``: the ``kinetic-prefect`` command."""

import sys

from kinetic_prefect.cli.app import main

sys.exit(main())
