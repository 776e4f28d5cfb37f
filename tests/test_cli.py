"""``python -m jagg.train``: config errors exit 2 with one line naming the key, before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jagg.config import TINY_RUN, load_config
from jagg.train import main

TINY = [*TINY_RUN, "sampling.num_steps=4"]


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("backward.jagg_frac=1.5", "backward.jagg_frac must be in [0, 1]"),
        ("backward.group_size=1", "backward.group_size must be an integer >= 2"),
        ("algorithm.clip_range=0", "algorithm.clip_range must be > 0"),
        ("algorithm.clip_range=-1e-4", "algorithm.clip_range must be > 0"),
        ("backward.strategy=fast", "backward.strategy must be one of"),
        ("backward.bogus=1", "unknown key backward.bogus"),
        ("train.iterations=ten", "train.iterations: expected int"),
        ("train.iterations=2.5", "train.iterations: expected int"),
        ("model.gradient_checkpointing=3", "model.gradient_checkpointing: expected bool"),
        ("algorithm.name=ppo", "algorithm.name must be one of"),
        ("reward.weights={hps: 1.0}", "reward.weights: unknown reward 'hps'"),
    ],
)
def test_bad_values_exit_2_and_write_nothing(tmp_path, capsys, override, names):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/world/flux_dancegrpo.yaml", *TINY, f"log.run_dir={run_dir}", override])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err
    assert not run_dir.exists()


def test_window_outside_schedule(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--config",
                "configs/world/flux_flowgrpo_fast.yaml",
                *TINY,
                f"log.run_dir={tmp_path / 'r'}",
                "algorithm.sde_window_range=[2, 9]",
            ]
        )
    assert exc.value.code == 2
    assert "algorithm.sde_window_range" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_missing_config_and_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(tmp_path / "nope.yaml")])
    assert exc.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--config",
                "configs/world/flux_dancegrpo.yaml",
                *TINY,
                f"log.run_dir={tmp_path / 'r'}",
                "--resume",
            ]
        )
    assert exc.value.code == 2 and "missing checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_inheritance_differs_only_where_declared():
    base, qwen = (
        load_config("configs/world/flux_dancegrpo.yaml"),
        load_config("configs/world/qwenimage_dancegrpo.yaml"),
    )
    a, b = base.to_dict(), qwen.to_dict()
    diff = {(s, k) for s in a for k in a[s] if a[s][k] != b[s][k]}
    assert diff == {("model", "backbone"), ("log", "run_dir")}


def test_cli_end_to_end_subprocess(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "jagg.train",
        "--config",
        "configs/world/flux_dancegrpo.yaml",
        *TINY,
        f"log.run_dir={run_dir}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    meta = json.loads((run_dir / "run.json").read_text())
    assert {"git_sha", "hardware", "versions", "config", "seed"} <= set(meta)
    assert meta["config"]["backward"]["strategy"] == "jagg"
    assert (run_dir / "checkpoint" / ".metadata").is_file()  # sharded (DCP) checkpoint directory
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 2 and "already exists" in again.stderr
