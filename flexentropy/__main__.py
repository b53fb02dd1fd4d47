"""``python -m flexentropy``: the same as the ``flexentropy`` command (see :mod:`flexentropy.cli`)."""

import sys

from flexentropy.cli import main

sys.exit(main())
