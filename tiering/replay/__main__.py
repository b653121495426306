"""``python -m tiering.replay``: the replay subcommand on its own."""

from tiering.replay.runner import main

raise SystemExit(main())
