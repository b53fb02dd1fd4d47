"""``python -m bench``: the same as the ``flexentropy`` command (see :mod:`bench.needle_demo`)."""

import sys

from bench.needle_demo import main

sys.exit(main())
