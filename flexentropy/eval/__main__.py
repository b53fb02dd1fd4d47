"""``python -m flexentropy.eval``: see `flexentropy.eval.cli`."""

from flexentropy.eval.cli import main

raise SystemExit(main())
