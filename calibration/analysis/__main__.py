"""``python -m patchkv_agent.calibration.analysis``: see :mod:`.cli`."""

import sys

from .cli import main

sys.exit(main())
