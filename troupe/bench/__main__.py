"""`python -m troupe.bench`: the same as `troupe bench` (troupe.bench.harness)."""

from __future__ import annotations

from troupe.bench.harness import main

raise SystemExit(main())
