"""The few named errors troupe raises.

- `InvalidInputError` (a `ValueError`): bad user input, caught at the edge; names the field and
  what is allowed. The engine stays healthy.
- `EngineDeadError`: fatal. Every in-flight request gets it and every new request raises it.
- `ModelLoadError` (a `ValueError`): a model path, file or config that cannot be loaded.
"""

from __future__ import annotations


class InvalidInputError(ValueError):
    """Bad input for one request: `field` names what was wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the file and the problem."""


class EngineDeadError(RuntimeError):
    """The engine died; no request can be served any more. `__cause__` holds the root cause."""

    def __init__(self, message: str = "EngineCore died; see the cause for the root error.") -> None:
        super().__init__(message)


class EngineGenerateError(RuntimeError):
    """An unexpected error inside one `generate()` call; the request was aborted."""
