"""``python -m equivariance_probe.cli``: the same program as the ``equivariance-probe`` command."""

import sys

from .program import main

sys.exit(main())
