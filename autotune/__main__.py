"""``python -m autotune`` behaves exactly like the ``autotune`` command."""

import sys

from autotune.cli import main

sys.exit(main())
