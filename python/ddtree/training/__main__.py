"""``python -m ddtree.training``: see :mod:`ddtree.training.pipeline`."""

import sys

from .pipeline import main

sys.exit(main())
