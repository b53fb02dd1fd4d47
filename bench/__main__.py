"""``python -m bench``: the ``flexentropy`` command with the lab's model aliases (see :mod:`bench.needle_demo`)."""

import sys

from bench.needle_demo import main

sys.exit(main())
