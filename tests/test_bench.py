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
    assert set(df.backbone) == {"flux", "qwenimage"}
    assert set(df.variant) == {s.label for s in bench_group_backward.variants(2)}
    assert set(df.variant) == {"exact", *(f"jagg/{m}{'+stored' * r}" for m, r in bench_group_backward.MODES)}
    rows = {r.variant: r for r in df[df.backbone == "flux"].itertuples()}
    w = int(rows["exact"].W)
    exact, paper, default = rows["exact"], rows["jagg/joint"], rows["jagg/batched+stored"]
    assert (exact.forward_passes, exact.backward_passes, exact.backward_calls) == (w, w, w)
    assert (
        paper.forward_passes,
        paper.forward_passes_with_grad,
        paper.backward_passes,
        paper.backward_calls,
    ) == (
        w,
        2,
        2,
        1,
    )
    # batched + stored: one forward call over both endpoints, no intermediate forward, one backward call
    assert (
        default.forward_passes,
        default.forward_calls,
        default.backward_passes,
        default.backward_calls,
    ) == (
        2,
        1,
        2,
        1,
    )
    assert rows["jagg/sequential"].backward_calls == 2
    assert (df.peak_saved_vs_exact > 0).all()
    assert (df.median_ms > 0).all() and df.ideal_speedup.notna().all()
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert {"git_sha", "hardware", "versions", "seed", "config"} <= set(meta)
    assert "CPU" in meta["hardware"] or "CUDA" in meta["hardware"]
    assert out.with_suffix(".md").read_text().startswith("# One-group backward")
