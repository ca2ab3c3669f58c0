"""``python -m autotune.worker JOB.json``: run one measurement (autotune.worker.main)."""

import sys

from autotune.worker.main import main

sys.exit(main())
