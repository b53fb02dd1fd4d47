"""``python -m flexentropy``: the ``flexentropy`` command (`flexentropy.cli`)."""

import sys

from flexentropy.cli import main

sys.exit(main())
