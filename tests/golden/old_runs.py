"""Write tests/golden/old_runs/<name>/: a one-iteration run directory written by the CLI of an earlier commit,
for tests/test_resume_versions.py (a run written by an earlier version resumes with the current code).

Run it from a checkout of that commit, with that checkout's sources first on the path:

    git worktree add --detach /tmp/old <commit>
    cd /tmp/old && PYTHONPATH=$PWD/src python <this repo>/tests/golden/old_runs.py <out> [key=value ...]

The committed ones (samples/ removed; nothing else edited):

    v0764738_before_landing         commit 0764738 (dc9c131^, the one before the last wave), no extra overrides
    ve882fca_before_plugin_config   commit e882fca (before the plug-in config), train.control_cosine=0.9
                                    train.control_direction=fresh log.fidelity_every=1 log.landing=true

Rerunning it with the current code writes runs of the current format instead (not what that test is for)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

# the smallest run: one iteration of one prompt x 2 images, LoRA rank 1 (a small checkpoint), no evaluation
TINY = [
    "model.source=tiny",
    "reward.weights={jpeg: 1.0}",
    "reward.eval=[jpeg]",
    "train.iterations=1",
    "train.prompts_per_iter=1",
    "train.images_per_prompt=2",
    "train.train_batch_size=2",
    "sampling.num_steps=4",
    "log.eval_every=0",
    "model.lora_rank=1",
    "model.lora_alpha=1",
    "log.heartbeat_s=0",
]


def main(out: str, *extra: str) -> None:
    from jagg.train import main as train

    shutil.rmtree(out, ignore_errors=True)
    argv = ["--config", "configs/world/flux_dancegrpo.yaml", *TINY, f"log.run_dir={out}", *extra]
    assert train(argv) == 0
    shutil.rmtree(Path(out) / "samples", ignore_errors=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
