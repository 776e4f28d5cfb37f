"""``log.report_to``: TensorBoard gets every numeric field of every metrics.jsonl row and the sample grids
(read back from the event files); the same rows, grids and the run metadata from a wandb offline run file (when
wandb is installed); unknown / missing trackers fail before anything is written."""

from __future__ import annotations

import importlib.util
import io
import json
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


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    """A second tracker on the same run directory (a resume) writes to the same wandb run id."""
    from jagg.ops.trackers import Trackers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for step in (0, 1):
        trackers = Trackers(["wandb"], tmp_path / "run", {"seed": 0})
        trackers.log_row({"iteration": step, "loss": float(step)})
        trackers.close()
        time.sleep(1.1)  # offline run folders are named by the second they start in
    files = sorted((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    run_id = (tmp_path / "run" / "wandb_run_id").read_text().strip()
    assert len(files) == 2 and {f.name for f in files} == {f"run-{run_id}.wandb"}
    assert [sorted(wandb_history(f)[0]) for f in files] == [[0], [1]]
