"""``python -m tiering.cli``: the ``tiering`` command."""

from tiering.cli import main

raise SystemExit(main())
