"""``python -m mmembed ...``: the ``mmembed`` command."""

import sys

from .tools.cli import main

sys.exit(main())
