"""``log.report_to``: TensorBoard gets every numeric field of every metrics.jsonl row and the sample grids
(read back from the event files); wandb offline when it is installed; unknown / missing trackers fail before
anything is written."""

from __future__ import annotations

import importlib.util
import io
import json

import numpy as np
import pytest
from PIL import Image

from jagg.config import TINY_RUN
from jagg.loop.trackers import scalars
from jagg.train import main

TRACKED = [
    "--config",
    "configs/world/flux_dancegrpo.yaml",
    *TINY_RUN,
    "sampling.num_steps=4",
    "train.iterations=2",
    "log.eval_every=1",
    "log.eval_prompts=2",
]


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_scalars_flatten_numbers_only():
    row = {"iteration": 3, "loss": 0.5, "skipped": True, "routing": [True], "cos": {"g0": 0.9}, "n": 2}
    assert scalars(row) == {"loss": 0.5, "cos/g0": 0.9, "n": 2.0}


def test_tensorboard_gets_the_metrics_rows_and_grids(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    assert main([*TRACKED, f"log.run_dir={run_dir}", "log.report_to=[tensorboard]"]) == 0
    events = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    expected: dict[str, dict[int, float]] = {}
    for row in rows:
        for name, value in scalars(row).items():
            expected.setdefault(name, {})[row["iteration"]] = value
    assert {"reward_mean", "loss", "backward_passes", "eval_jpeg_mean", "time_iteration_s"} <= set(expected)
    assert set(acc.Tags()["scalars"]) == set(expected)
    for name, by_step in expected.items():
        got = {e.step: e.value for e in acc.Scalars(name)}
        assert got.keys() == by_step.keys(), name
        np.testing.assert_allclose([got[s] for s in by_step], list(by_step.values()), rtol=1e-6, err_msg=name)
    # the sample grid of each evaluation, the same picture as samples/iter_*.png
    images = acc.Images("samples")
    assert [e.step for e in images] == [0, 1, 2]
    logged = np.asarray(Image.open(io.BytesIO(images[-1].encoded_image_string)).convert("RGB"))
    saved = np.asarray(Image.open(run_dir / "samples" / "iter_00002.png").convert("RGB"))
    np.testing.assert_array_equal(logged, saved)
    assert "config/text_summary" in acc.Tags()["tensors"]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    assert main([*TRACKED, f"log.run_dir={run_dir}", "log.report_to=[wandb]"]) == 0
    assert list((run_dir / "wandb").glob("offline-run-*"))


def test_unknown_or_missing_tracker_fails_before_writing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main([*TRACKED, f"log.run_dir={run_dir}", "log.report_to=[tensorbord]"])
    assert exc.value.code == 2 and "log.report_to: unknown tracker 'tensorbord'" in capsys.readouterr().err
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(SystemExit) as exc:
            main([*TRACKED, f"log.run_dir={run_dir}", "log.report_to=[wandb]"])
        assert exc.value.code == 2 and "log.report_to: wandb is not installed" in capsys.readouterr().err
    assert not run_dir.exists()
