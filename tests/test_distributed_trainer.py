"""The trainer under FSDP2 with 2 gloo processes on CPU (tiny world backbone, JPEG reward).

* the real CLI under ``torchrun --nproc_per_node 2`` runs 2 iterations and only rank 0 writes;
* the first update equals a single-process run on the same global batch: each rank samples half of the
  micro-batches (same prompts, noise and SDE seeds as the single process), rewards are gathered before the
  advantages (a prompt group spans both ranks here), and FSDP2 averages the gradients. Single process:
  2 micro-batches, grad_accum 2; two ranks: 1 micro-batch each, grad_accum 1 -> identical gradient.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dist_harness import run_ranks
from jagg.config import TINY_OVERRIDES

WORLD = 2
TINY = [
    *TINY_OVERRIDES,
    "train.iterations=1",
    "train.prompts_per_iter=1",
    "train.images_per_prompt=4",  # one prompt group of 4 split 2 + 2 over the ranks
    "train.train_batch_size=2",
    "sampling.num_steps=6",
    "log.eval_every=0",
    "optim.lr=1e-3",
    "algorithm.clip_range=0.2",
]


def _cfg(run_dir, strategy: str, grad_accum: int):
    from helpers import tiny_config

    return tiny_config(run_dir, f"backward.strategy={strategy}", f"train.grad_accum={grad_accum}", base=TINY)


def _run(cfg) -> dict:
    """One iteration; returns the metrics row, the full gradient before the step and the updated weights."""
    from helpers import build_trainer
    from jagg.distributed import full_tensor

    trainer = build_trainer(cfg)
    grads = []
    step = trainer._optimizer_step

    def record_then_step(*args):  # args: the fidelity measurement, if any
        grads.append([full_tensor(p.grad).clone() for p in trainer.params])
        return step(*args)

    trainer._optimizer_step = record_then_step
    (row,) = trainer.fit()
    return {"row": row, "grads": grads, "params": [full_tensor(p.detach()).clone() for p in trainer.params]}


def trainer_worker(rank: int, out_dir: str) -> None:
    """One rank (run by ``dist_harness.run_ranks``, which owns the process group)."""
    for strategy in ("jagg", "exact"):
        res = _run(_cfg(os.path.join(out_dir, strategy), strategy, grad_accum=1))
        if rank == 0:
            torch.save(res, os.path.join(out_dir, f"{strategy}.pt"))


@pytest.fixture(scope="module")
def two_process(tmp_path_factory):
    return run_ranks(
        "test_distributed_trainer:trainer_worker", WORLD, tmp_path_factory.mktemp("fsdp_trainer")
    )


@pytest.mark.parametrize("strategy", ["jagg", "exact"])
def test_two_process_update_equals_single_process(two_process, tmp_path, strategy):
    single = _run(_cfg(tmp_path, strategy, grad_accum=2))
    multi = torch.load(two_process / f"{strategy}.pt", weights_only=False)
    assert len(single["grads"]) == len(multi["grads"]) == 1  # one optimizer step each
    g1, g2 = (torch.cat([g.flatten() for g in r["grads"][0]]) for r in (single, multi))
    assert g1.norm() > 0
    assert (g1 - g2).abs().max() <= 1e-5 * g1.abs().max(), ((g1 - g2).abs().max(), g1.abs().max())
    for a, b in zip(single["params"], multi["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    r1, r2 = single["row"], multi["row"]
    for key in ("reward_mean", "reward_std", "onpolicy_ratio_max_dev", "optimizer_steps"):
        assert r1[key] == pytest.approx(r2[key], rel=1e-6, abs=1e-9), key
    for key in ("loss", "grad_norm", "clip_frac"):
        assert r1[key] == pytest.approx(r2[key], rel=1e-5, abs=1e-9), key
    assert r2["backward_passes_per_sample"] == r1["backward_passes_per_sample"]


def test_torchrun_cli_two_processes_rank0_writes(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        torchrun,
        "--standalone",
        f"--nproc_per_node={WORLD}",
        "-m",
        "jagg.train",
        "--config",
        "configs/world/flux_dancegrpo.yaml",
        *TINY,
        "train.iterations=2",
        "log.checkpoint_every=1",
        f"log.run_dir={run_dir}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]  # written once (rank 0), not once per rank
    assert all(r["onpolicy_ratio_max_dev"] == 0.0 for r in rows)
    assert json.loads((run_dir / "run.json").read_text())["world_size"] == WORLD
    shards = sorted(p.name for p in (run_dir / "checkpoint").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # sharded checkpoint: one file per rank
    assert out.stdout.count("done:") == 1
