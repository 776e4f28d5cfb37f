"""Smoke test of the group-backward benchmark driver (seconds-scale; timings are not asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import bench_group_backward  # noqa: E402


def test_bench_quick_writes_counts_and_metadata(tmp_path):
    out = tmp_path / "bench.csv"
    bench_group_backward.main(["--quick", "--out", str(out), "--backbones", "flux", "qwenimage"])
    df = pd.read_csv(out)
    assert set(df.strategy) == {"exact", "jagg"} and set(df.backbone) == {"flux", "qwenimage"}
    exact, jagg = df[df.strategy == "exact"].iloc[0], df[df.strategy == "jagg"].iloc[0]
    w = int(exact.W)
    assert (exact.forward_passes, exact.backward_passes, exact.backward_calls) == (w, w, w)
    assert (
        jagg.forward_passes,
        jagg.forward_passes_with_grad,
        jagg.backward_passes,
        jagg.backward_calls,
    ) == (w, 2, 2, 1)
    assert (df.median_ms > 0).all() and df.ideal_speedup.notna().all()
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert {"git_sha", "hardware", "versions", "seed", "config"} <= set(meta)
    assert "CPU" in meta["hardware"] or "CUDA" in meta["hardware"]
    assert out.with_suffix(".md").read_text().startswith("# One-group backward")
