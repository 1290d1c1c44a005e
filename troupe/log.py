"""Logging set-up: structlog, configured by troupe through `configure_logging()` only.

- Importing troupe changes nothing. `configure_logging()` runs when an engine or the CLI starts,
  and only if the program has not configured structlog itself (`structlog.is_configured()`):
  a program that configures structlog keeps control of troupe's lines too.
- If the program configured stdlib logging (the root logger has handlers), troupe's lines go
  through stdlib logging (logger names `troupe.*`), so its handlers and levels apply.
- Otherwise lines go to stderr, rendered as `TROUPE_LOG_FORMAT` (`console` or `json`) at
  `TROUPE_LOG_LEVEL` (`trace`, `debug`, `info`, `warning`, `error`; default `info`).
- `trace` is a level below debug for per-hop request tracing; hot paths guard it with
  `trace_enabled()` so disabled tracing costs a global read.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

TRACE = 5
_LEVELS = {"trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}
_trace = False


def trace_enabled() -> bool:
    return _trace


def _level(name: str | None) -> int:
    name = (name or os.environ.get("TROUPE_LOG_LEVEL") or "info").lower()
    if name not in _LEVELS:
        raise ValueError(f"TROUPE_LOG_LEVEL: must be one of {sorted(_LEVELS)}, got {name!r}")
    return _LEVELS[name]


def configure_logging(level: str | None = None, fmt: str | None = None, *, force: bool = False) -> bool:
    """Configure structlog for troupe unless the program did; returns True if it configured."""
    global _trace
    lvl = _level(level)
    _trace = lvl <= TRACE
    if structlog.is_configured() and not force:
        return False
    fmt = (fmt or os.environ.get("TROUPE_LOG_FORMAT") or "console").lower()
    if fmt not in ("console", "json"):
        raise ValueError(f"TROUPE_LOG_FORMAT: must be 'console' or 'json', got {fmt!r}")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    to_stdlib = bool(logging.getLogger().handlers) and not force
    if to_stdlib:
        processors = [*shared, structlog.processors.format_exc_info,
                      structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)]
        factory: Any = structlog.stdlib.LoggerFactory()
    else:
        processors = [*shared,
                      structlog.processors.format_exc_info if fmt == "json" else structlog.dev.set_exc_info,
                      structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer()]
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(max(lvl, logging.DEBUG)),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    return True
