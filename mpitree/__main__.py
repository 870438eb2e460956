"""``python -m mpitree``: see :mod:`mpitree.cli`."""

import sys

from .cli import main

sys.exit(main())
