"""``python -m bench.eval``: see `bench.eval.commands`."""

from bench.eval.commands import main

raise SystemExit(main())
