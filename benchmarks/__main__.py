"""``python -m benchmarks``: run every measure (see :mod:`benchmarks.run_all`)."""

import sys

from benchmarks.run_all import main

sys.exit(main())
