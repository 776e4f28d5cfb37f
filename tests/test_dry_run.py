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
    for text in (
        "trained steps per sample",
        "cost per sample by endpoint mode",
        "memory per rank",
        "group 0",
    ):
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
    # configured: DanceGRPO's cadence, 24 samples per rank = 12 micro-batches, a step every 6 (two per iteration);
    # stored outputs serve the first accumulation window only
    assert "* jagg/batched+stored" in out
    assert "6 of 12 micro-batches" in out and "step every 6" in out
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


def test_paper_recipes_follow_the_references():
    """Values taken from the reference code (each config's header comment cites the file)."""
    for b in ("flux", "qwenimage"):
        dance = load_config(f"configs/paper/{b}_dancegrpo.yaml")
        assert dance.algorithm.init_same_noise  # every DanceGRPO launch script passes --init_same_noise
        t = dance.train  # 8 GPUs: 2 prompts x 12 per rank, a step every 12 samples -> 2 steps per iteration
        per_rank = t.prompts_per_iter * t.images_per_prompt // 8
        assert (
            per_rank,
            t.train_batch_size * t.grad_accum,
            per_rank // (t.train_batch_size * t.grad_accum),
        ) == (
            24,
            12,
            2,
        )
        assert dance.model.true_cfg_scale == 1.0 and dance.sampling.schedule == "shift"  # --cfg 0.0, shift 3
    flux, qwen = (load_config(f"configs/paper/{b}_flowgrpo_fast.yaml") for b in ("flux", "qwenimage"))
    assert flux.model.max_sequence_length == 128 and qwen.model.max_sequence_length == 512
    assert flux.algorithm.adv_std == "group" and qwen.algorithm.adv_std == "global"  # global_std False / True
    assert flux.algorithm.sde_window_range == [0, 3] and qwen.algorithm.sde_window_range == [0, 5]
    fast = _diff("configs/paper/flux_flowgrpo_fast.yaml", "configs/paper/qwenimage_flowgrpo_fast.yaml")
    assert {
        ("model", "max_sequence_length"),
        ("algorithm", "adv_std"),
        ("algorithm", "sde_window_range"),
    } <= fast
