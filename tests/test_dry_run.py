"""``python -m jagg.train --dry-run``: every paper config validates and prints its plan offline, without
weights; the paper configs differ only where their experiments differ."""

from __future__ import annotations

import glob

import pytest

from jagg.config import load_config
from jagg.train import main

PAPER = sorted(glob.glob("configs/paper/*_*.yaml"))


def test_all_four_paper_configs_exist():
    names = {p.split("/")[-1] for p in PAPER}
    assert names == {f"{b}_{a}.yaml" for b in ("flux", "qwenimage") for a in ("dancegrpo", "flowgrpo_fast")}


@pytest.mark.parametrize("config", PAPER)
def test_dry_run_prints_plan_offline(tmp_path, capsys, monkeypatch, config):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_dir = tmp_path / "run"
    assert main(["--config", config, "--dry-run", "--world-size", "8", f"log.run_dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(config)
    for text in ("trained steps per sample", "cost per sample by endpoint mode", "memory per rank", "group 0"):
        assert text in out
    assert f"W={cfg.backward.group_size}, jagg_frac=0.6" in out
    assert "-> jagg" in out and "over 8" in out
    assert not run_dir.exists()  # a dry run writes nothing


def test_dry_run_counts(capsys):
    """Flux DanceGRPO: 9 trained steps, groups of 3, JAGG on round(0.6 * 3) = 2 groups: 7 backward graphs."""
    assert main(["--config", "configs/paper/flux_dancegrpo.yaml", "--dry-run", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "9 of 16" in out and "group 2                            steps [6, 7, 8] -> exact" in out
    rows = {ln.split()[-8]: ln.split()[-6:] for ln in out.splitlines() if len(ln.split()) >= 8}
    # forwards (grad), backward passes, backward calls, all-gathers, reduce-scatters per unit, graphs alive
    assert rows["exact"] == ["(9)", "9", "9", "18", "9", "1"]
    assert rows["jagg/joint"] == ["(7)", "7", "5", "16", "5", "2"]  # the paper's recipe
    assert rows["jagg/batched+stored"] == ["(7)", "7", "5", "10", "5", "2"]  # the default
    assert rows["jagg/sequential"] == ["(7)", "7", "7", "16", "7", "1"]
    assert "* jagg/batched+stored" in out  # configured: 6 micro-batches, one optimizer step
    assert "6 of 6 micro-batches" in out
    assert "11.90B total" in out  # FLUX.1-dev transformer built on the meta device


def test_dry_run_rejects_world_size_that_splits_micro_batches(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/paper/flux_dancegrpo.yaml", "--dry-run", "--world-size", "5"])
    assert exc.value.code == 2
    assert "world_size * train.train_batch_size" in capsys.readouterr().err


def _diff(a: str, b: str) -> set[tuple[str, str]]:
    x, y = load_config(a).to_dict(), load_config(b).to_dict()
    return {(s, k) for s in x for k in x[s] if x[s][k] != y[s][k]}


def test_paper_configs_differ_only_where_declared():
    assert _diff("configs/paper/flux_dancegrpo.yaml", "configs/paper/qwenimage_dancegrpo.yaml") == {
        ("model", "backbone"),
        ("model", "path"),
        ("sampling", "num_steps"),
        ("sampling", "eval_num_steps"),
        ("log", "run_dir"),
    }
    fast = _diff("configs/paper/flux_flowgrpo_fast.yaml", "configs/paper/qwenimage_flowgrpo_fast.yaml")
    assert {s for s, _ in fast} == {"model", "sampling", "algorithm", "backward", "train", "log"}
    assert ("optim", "lr") not in fast and ("reward", "weights") not in fast
