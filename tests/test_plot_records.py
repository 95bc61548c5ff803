"""The plot script reads the records it plots (the pure parts; matplotlib is not a test dependency)."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plot_records", ROOT / "benches" / "plot_records.py")
plot_records = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_records)


def test_series_come_from_the_records():
    metrics = json.loads(Path(plot_records.PAIR_METRICS).read_text())
    chain, trees = plot_records.acceptance_series(metrics)
    assert [b for b, _ in trees] == [16, 32, 64, 128, 256] and all(t > chain for _, t in trees)
    fractions = plot_records.depth_fractions(metrics["eval"]["modes"]["chain"])
    assert abs(1.0 + sum(fractions) - chain) < 1e-6  # steps reaching each depth add up to the acceptance length
    rows = json.loads(Path(plot_records.GRAPH_BENCH).read_text())
    series = plot_records.throughput_series(rows)
    assert set(series) == {"none", "dflash", "ddtree-64", "ddtree-256"}
    assert all([b for b, _ in points] == [1, 8, 32] for points in series.values())
    assert plot_records.budget_of("ddtree-64") == 64 and plot_records.budget_of("chain") is None
