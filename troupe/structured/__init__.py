"""Structured outputs: `StructuredOutputsParams` (the request's constraint) and, imported on demand
(they load the xgrammar backend), the grammar compiler and per-request matchers (`troupe.structured.backend`,
`troupe.structured.manager`)."""

from __future__ import annotations

from troupe.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
