"""Logging set-up: structlog, configured by troupe through `configure_logging()` only.

- Importing troupe changes nothing. `configure_logging()` runs when an engine or the CLI starts,
  and only if the program has not configured structlog itself (`structlog.is_configured()`):
  a program that configures structlog keeps control of troupe's lines too.
- If the program configured stdlib logging (the root logger has handlers), troupe's lines go
  through stdlib logging (logger names `troupe.*`), so its handlers and levels apply.
- Otherwise lines go to stderr, rendered as `TROUPE_LOG_FORMAT` (`console` or `json`: one JSON
  object per line) at `TROUPE_LOG_LEVEL` (`trace`, `debug`, `info`, `warning`, `error`; default
  `info`).
- troupe's logger class (`TroupeBoundLogger`) reads the level at each call, so `set_level()` takes
  effect on loggers already in use (structlog caches them on first use).

Trace: a level below debug for following one request hop by hop (docs/debugging.md). Emit with
`trace(log, "event", **fields)`; it is dropped unless the level is `trace`. Where building the
fields costs something (per step, per output), guard the call with `if trace_enabled():`, a
function returning a module global: disabled tracing then costs one call and a bool test.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog

TRACE = 5
_LEVELS = {"trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}
_NAMES = {number: name for name, number in _LEVELS.items()}
_level = logging.INFO  # troupe's threshold (TroupeBoundLogger and the trace switch)
_trace = False
_level_set = False  # set once by configure_logging / set_level; later configure calls keep it


def trace_enabled() -> bool:
    """Whether trace lines are logged (the level is `trace`): the guard for hot paths."""
    return _trace


def _parse(level: str | int) -> int:
    if isinstance(level, int):
        return level
    name = level.lower()
    if name not in _LEVELS:
        raise ValueError(f"TROUPE_LOG_LEVEL: must be one of {sorted(_LEVELS)}, got {level!r}")
    return _LEVELS[name]


def set_level(level: str | int) -> int:
    """Set troupe's level (a name or a number, `TRACE` = 5); returns the previous one.

    It applies at once to every line logged through troupe's own configuration, and to the trace
    switch whoever configured structlog."""
    global _level, _trace, _level_set
    previous, _level = _level, _parse(level)
    _trace = _level <= TRACE
    _level_set = True
    return previous


def trace(logger: Any, event: str, **fields: Any) -> None:
    """Log a trace line (level `trace`) if tracing is on; otherwise nothing happens.

    With troupe's configuration the line says `level=trace`; a logger of another configuration
    (one without a `trace` method) gets it as a debug line."""
    if not _trace:
        return
    method = getattr(logger, "trace", None)
    (method if method is not None else logger.debug)(event, **fields)


class TroupeBoundLogger(structlog.BoundLoggerBase):
    """troupe's structlog wrapper class: filters against troupe's current level, adds `trace`."""

    def _at(self, number: int, name: str, event: str, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        if number < _level:
            return None
        return self._proxy_to_logger(name, event % args if args else event, **kw)

    def trace(self, event: str, *args: Any, **kw: Any) -> Any:
        if not _trace:
            return None
        return self._proxy_to_logger("trace", event % args if args else event, **kw)

    def debug(self, event: str, *args: Any, **kw: Any) -> Any:
        if _level > logging.DEBUG:
            return None
        return self._proxy_to_logger("debug", event % args if args else event, **kw)

    def info(self, event: str, *args: Any, **kw: Any) -> Any:
        return self._at(logging.INFO, "info", event, args, kw)

    def warning(self, event: str, *args: Any, **kw: Any) -> Any:
        return self._at(logging.WARNING, "warning", event, args, kw)

    warn = warning

    def error(self, event: str, *args: Any, **kw: Any) -> Any:
        return self._at(logging.ERROR, "error", event, args, kw)

    def critical(self, event: str, *args: Any, **kw: Any) -> Any:
        return self._at(logging.CRITICAL, "critical", event, args, kw)

    fatal = critical

    def exception(self, event: str, *args: Any, **kw: Any) -> Any:
        kw.setdefault("exc_info", True)
        return self._at(logging.ERROR, "error", event, args, kw)

    def log(self, level: int, event: str, *args: Any, **kw: Any) -> Any:
        if level <= TRACE:
            return self.trace(event, *args, **kw)
        return self._at(level, _NAMES.get(level, "info"), event, args, kw)

    def is_enabled_for(self, level: int) -> bool:
        return level >= _level


def console(colors: bool) -> Any:
    """structlog's console renderer with plain tracebacks: its default, where `rich` is installed
    (transformers brings it), renders each traceback with every frame's locals, seconds of CPU
    for a deep one, on whatever thread logs it (the server's event loop among them)."""
    return structlog.dev.ConsoleRenderer(colors=colors, exception_formatter=structlog.dev.plain_traceback)


class _PrintSink(structlog.PrintLogger):
    """structlog's PrintLogger, with a `trace` method."""

    trace = structlog.PrintLogger.msg


class _StdlibSink:
    """A stdlib logger for rendered lines; trace lines go out at stdlib DEBUG."""

    def __init__(self, *args: Any) -> None:
        self._logger = logging.getLogger(args[0] if args and isinstance(args[0], str) else "troupe")

    def trace(self, message: str) -> None:
        self._logger.debug(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


def configure_logging(level: str | None = None, fmt: str | None = None, *, force: bool = False,
                      file: TextIO | None = None) -> bool:
    """Configure structlog for troupe unless the program did; returns True if it configured.

    `level` (else `TROUPE_LOG_LEVEL` the first time) sets troupe's level in any case: the filter of
    troupe's configuration, and the trace switch. `fmt` (else `TROUPE_LOG_FORMAT`): `console` or
    `json`. `force` replaces any configuration, stdlib routing included; `file` is the sink
    (default stderr) when troupe prints the lines itself."""
    if level is not None:
        set_level(level)
    elif force or not _level_set:
        set_level(os.environ.get("TROUPE_LOG_LEVEL") or "info")
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
    factory: Any
    if to_stdlib:
        processors = [*shared, structlog.processors.format_exc_info,
                      structlog.processors.JSONRenderer() if fmt == "json" else console(colors=False)]
        factory = _StdlibSink
    else:
        sink = file if file is not None else sys.stderr
        colors = bool(getattr(sink, "isatty", lambda: False)())
        processors = [*shared,
                      structlog.processors.format_exc_info if fmt == "json" else structlog.dev.set_exc_info,
                      structlog.processors.JSONRenderer() if fmt == "json" else console(colors=colors)]
        factory = lambda *args: _PrintSink(sink)  # noqa: E731
    structlog.configure(
        processors=processors,
        wrapper_class=TroupeBoundLogger,
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    return True
