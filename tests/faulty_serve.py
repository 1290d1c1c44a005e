"""`troupe serve` with a TEST-ONLY engine fault (tests/support/faults.py), for the server lifecycle tests.

    python tests/faulty_serve.py SPEC [serve arguments...]

runs exactly what `troupe serve [serve arguments...]` runs, with the fault hooks SPEC names
(for example `raise_after_steps=3`: the model raises on its 4th step and the engine dies).
"""

from __future__ import annotations

import sys

from support.faults import fault_hooks

from troupe.cli import build_parser, engine_options
from troupe.server.launcher import serve

if __name__ == "__main__":
    spec, argv = sys.argv[1], sys.argv[2:]
    args = build_parser().parse_args(["serve", *argv])
    raise SystemExit(serve(args, {**engine_options(args), "hooks": fault_hooks(spec)}))
