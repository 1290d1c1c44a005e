"""`python -m troupe.bench`: the same as `troupe bench` (troupe.bench.offline)."""

from __future__ import annotations

from troupe.bench.offline import main

raise SystemExit(main())
