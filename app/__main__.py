"""`python -m app` is `specdeck`."""

from app.cli import main

raise SystemExit(main())
