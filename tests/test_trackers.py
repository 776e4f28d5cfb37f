"""``log.report_to``: TensorBoard gets every numeric field of every metrics.jsonl row and the sample grids
(read back from the event files); the same rows, grids and the run metadata from a wandb offline run file (when
wandb is installed); unknown / missing trackers fail before anything is written."""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import struct
import time

import numpy as np
import pytest
import torch
from PIL import Image

from jagg.config import TINY_RUN
from jagg.ops.trackers import scalars
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


def wandb_records(path):
    """The protobuf ``Record``s of a wandb run file (``run-<id>.wandb``), read without wandb's own reader.

    The file is wandb's 7-byte header (``:W&B``, magic, version) followed by the LevelDB log format: 32 KiB
    blocks of chunks, each ``crc32c (4) | length (2, LE) | type (1: full, 2: first, 3: middle, 4: last)``.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block trailer / zero padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def wandb_history(run_file) -> tuple[dict[int, dict], dict]:
    """({step: {key: value}} of every history record, the run's config {key: value}) of an offline run file."""
    history: dict[int, dict] = {}
    config: dict = {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
    return history, config


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
@pytest.mark.parametrize("mode", ["env_offline", "default"])
def test_wandb_offline_history_read_back(tmp_path, monkeypatch, mode):
    """Every numeric field of every metrics.jsonl row at its iteration, the sample grids, and the config with the
    git SHA / hardware / versions, read back from the offline run file. ``default``: no WANDB_MODE and no API key
    set up, so the run must go offline by itself (online would try to log in and fail here)."""
    from jagg.common import git_sha, hardware

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    if mode == "env_offline":
        monkeypatch.setenv("WANDB_MODE", "offline")
    else:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    run_dir = tmp_path / "run"
    assert main([*TRACKED, f"log.run_dir={run_dir}", "log.report_to=[wandb]"]) == 0
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert run_file.name == f"run-{run_id}.wandb"
    history, config = wandb_history(run_file)
    rows = _rows(run_dir)
    assert sorted(history) == [r["iteration"] for r in rows] == [0, 1, 2]
    names = set().union(*(scalars(r) for r in rows))
    assert {"reward_mean", "loss", "backward_passes", "eval_jpeg_mean", "time_iteration_s"} <= names
    for row in rows:
        logged = history[row["iteration"]]
        expected = scalars(row)
        assert set(expected) <= set(logged)
        for name, value in expected.items():
            np.testing.assert_allclose(logged[name], value, rtol=1e-12, err_msg=name)
        # the sample grid, the same picture as samples/iter_*.png
        assert logged["samples/_type"] == "image-file"
        png = run_file.parent / "files" / logged["samples/path"]
        saved = run_dir / "samples" / f"iter_{row['iteration']:05d}.png"
        np.testing.assert_array_equal(
            np.asarray(Image.open(png).convert("RGB")), np.asarray(Image.open(saved).convert("RGB"))
        )
    run_json = json.loads((run_dir / "run.json").read_text())
    assert config["git_sha"] == git_sha() == run_json["git_sha"]
    assert config["hardware"] == hardware() == run_json["hardware"]
    assert (
        config["versions"] == run_json["versions"]
        and config["versions"]["torch"] == torch.__version__.split("+")[0]
    )
    assert config["model"] == run_json["config"]["model"] and config["backward"]["strategy"] == "jagg"


def test_wandb_default_mode(tmp_path, monkeypatch):
    """Offline unless an API key is set up: WANDB_API_KEY, or a netrc entry for the wandb host."""
    from jagg.ops.trackers import wandb_default_mode

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    netrc_file = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert wandb_default_mode() == "offline"  # no netrc file
    netrc_file.write_text("machine example.com login user password secret\n")
    netrc_file.chmod(0o600)
    assert wandb_default_mode() == "offline"  # an entry for another host
    netrc_file.write_text("machine api.wandb.ai login user password k3y\n")
    assert wandb_default_mode() == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert wandb_default_mode() == "offline"  # a self-hosted server without its entry
    netrc_file.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k3y")
    assert wandb_default_mode() == "online"


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


def _resumed_from_an_earlier_checkpoint(run_dir, *trackers: str) -> None:
    """A run of 2 iterations (rows 0, 1, 2: evaluations at each) with checkpoints at 1 and 2, put back to the
    checkpoint of iteration 1, then resumed for 3 iterations: iteration 2 is redone, 3 is new."""
    every = ["log.checkpoint_every=1", "log.keep_checkpoints=2", f"log.report_to=[{','.join(trackers)}]"]
    assert main([*TRACKED, f"log.run_dir={run_dir}", *every]) == 0
    shutil.rmtree(run_dir / "checkpoint")
    (run_dir / "checkpoint.prev").rename(run_dir / "checkpoint")  # as if preempted before the second save
    time.sleep(1.1)  # wandb's offline run folders are named by the second they start in
    assert main(["--resume", *TRACKED, "train.iterations=3", f"log.run_dir={run_dir}", *every]) == 0
    assert [r["iteration"] for r in _rows(run_dir)] == [0, 1, 2, 3]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_after_a_resume_from_an_earlier_checkpoint_shows_the_resumed_trajectory(tmp_path, monkeypatch):
    """Each attempt is its own wandb run. The resumed one is linked to the first (its config's resumed_from:
    the first run's id and the checkpoint's iteration) and holds every row of metrics.jsonl at its iteration,
    the checkpoint's rows logged again (grids included): the redone iteration 2 is the resumed run's, not the
    first attempt's. (Before, the resume reopened the same run, and wandb dropped the steps it had seen.)"""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    _resumed_from_an_earlier_checkpoint(run_dir, "wandb")
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))  # oldest first
    assert len(files) == 2
    (first, first_config), (resumed, config) = (wandb_history(f) for f in files)
    first_id, newest = (f.name.removeprefix("run-").removesuffix(".wandb") for f in files)
    assert first_id != newest == (run_dir / "wandb_run_id").read_text().strip()
    assert "resumed_from" not in first_config and sorted(first) == [0, 1, 2]
    assert config["resumed_from"] == {"wandb_run": first_id, "iteration": 1}
    rows = _rows(run_dir)
    assert sorted(resumed) == [r["iteration"] for r in rows]
    for row in rows:
        logged = resumed[row["iteration"]]
        for name, value in scalars(row).items():
            np.testing.assert_allclose(logged[name], value, rtol=1e-12, err_msg=name)
        assert logged["samples/_type"] == "image-file"


def test_tensorboard_after_a_resume_from_an_earlier_checkpoint_drops_the_redone_steps(tmp_path):
    """The first attempt's events at the redone iteration 2 are purged (a SessionLog.START at step 2): every
    scalar has one value per step, metrics.jsonl's; the checkpoint's steps 0 and 1 stay from the first file."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    _resumed_from_an_earlier_checkpoint(run_dir, "tensorboard")
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    rows = _rows(run_dir)
    for name in ("loss", "reward_mean", "time_iteration_s"):
        by_step = {r["iteration"]: scalars(r)[name] for r in rows if name in scalars(r)}
        events = acc.Scalars(name)
        assert [e.step for e in events] == sorted(by_step), name  # each step once: the earlier 2 is gone
        np.testing.assert_allclose([e.value for e in events], [by_step[e.step] for e in events], rtol=1e-6)
    assert [e.step for e in acc.Images("samples")] == [0, 1, 2, 3]


def test_wandb_restart_links_and_replays_with_a_mocked_wandb(tmp_path, monkeypatch):
    """What ``WandbTracker`` asks of wandb, without wandb: a new id per attempt, no ``resume`` of the old id,
    ``resumed_from`` in the config, the checkpoint's rows logged again at their steps."""
    import sys
    import types

    from jagg.ops.trackers import WandbTracker

    calls = []

    class Run:
        def __init__(self, **kw):
            self.config = types.SimpleNamespace(update=lambda d, **k: calls.append(("config", d)))
            calls.append(("init", kw))

        def log(self, data, step):
            calls.append(("log", step, sorted(data)))

    fake = types.SimpleNamespace(init=lambda **kw: Run(**kw), Image=lambda path: path)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "wandb_run_id").write_text("abc123\n")  # an earlier attempt's run
    tracker = WandbTracker(run_dir, {"seed": 0})
    _, init = calls[0]
    assert init["id"] != "abc123" and "resume" not in init and "resume_from" not in init
    assert init["config"]["resumed_from"] == {"wandb_run": "abc123", "iteration": 0}
    assert init["id"] == (run_dir / "wandb_run_id").read_text().strip() and init["name"] == "run"
    (run_dir / "samples").mkdir()
    (run_dir / "samples" / "iter_00000.png").write_bytes(b"png")
    tracker.restart([{"iteration": 0, "eval_x_mean": 0.5}, {"iteration": 1, "loss": 0.25}])
    assert calls[1:] == [
        ("config", {"resumed_from": {"wandb_run": "abc123", "iteration": 1}}),
        ("log", 0, ["eval_x_mean"]),
        ("log", 0, ["samples"]),
        ("log", 1, ["loss"]),
    ]
    assert "resumed at iteration 1 from wandb run abc123" in tracker.run.notes
