"""`EngineStats`: what the frontend knows of its engines' work, apart from any request: the latest
`SchedulerStats` each engine published with its step outputs, the tokens each computed in total,
and when an engine last showed progress (a step's outputs or a utility reply).

The output handler records into it; the stats logger, the hang watch (`Graph.stalled_for`),
`AsyncLLM.engine_stats` and the server's /metrics read it. Touched from the graph's event loop only.
"""

from __future__ import annotations

import time

from troupe.messages import EngineCoreOutputs, SchedulerStats


class EngineTotals:
    """Cumulative tokens one engine computed, summed from its per-step stats."""

    __slots__ = ("prompt_tokens", "generation_tokens", "steps")

    def __init__(self) -> None:
        self.prompt_tokens = self.generation_tokens = self.steps = 0


class EngineStats:
    def __init__(self, num_engines: int = 1) -> None:
        # every engine has stats (idle) from the start, for /metrics and the stats line
        self.latest: dict[int, SchedulerStats] = {rank: SchedulerStats() for rank in range(num_engines)}
        self.totals: dict[int, EngineTotals] = {}
        self.last_progress = time.monotonic()

    def record(self, msg: EngineCoreOutputs) -> None:
        """One step's outputs arrived (one message per step)."""
        self.last_progress = time.monotonic()
        stats = msg.scheduler_stats
        if stats is not None:
            self.latest[msg.engine_index] = stats
            totals = self.totals.get(msg.engine_index)
            if totals is None:
                totals = self.totals[msg.engine_index] = EngineTotals()
            totals.prompt_tokens += stats.num_prompt_tokens
            totals.generation_tokens += stats.num_generation_tokens
            totals.steps += 1

    def progressed(self) -> None:
        """A sign of life other than a step (a utility reply)."""
        self.last_progress = time.monotonic()
