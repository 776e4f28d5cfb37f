"""Write tests/golden/checkpoints/<case>/: a run directory holding the checkpoint the trainer wrote at iteration 2
of a golden case (tests/golden/trainer_runs.py) with LoRA rank 1 (a small checkpoint).

The committed ones were written by the trainer before the plug-in refactor, whose progress.pt kept the measured
calibration in its own keys; ``tests/test_golden_runs.py`` resumes them with the current code. Rerunning this
script with the current code writes checkpoints of the current format instead (not what that test is for)."""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import trainer_runs  # noqa: E402

from helpers import build_trainer, tiny_config  # noqa: E402

CASES = ("groups_auto", "windows_auto", "knots_auto")
LORA = ("model.lora_rank=1", "model.lora_alpha=1")  # a small checkpoint: the adapters and their AdamW state


class Preempted(Exception):
    pass


def stop():
    raise Preempted


def main() -> None:
    import torch

    torch.set_num_threads(1)
    for case in CASES:
        config, extra = trainer_runs.cases()[case]
        out = HERE / "checkpoints" / case
        shutil.rmtree(out, ignore_errors=True)
        cfg = tiny_config(
            out,
            *trainer_runs.GOLDEN_RUN,
            *extra,
            *LORA,
            "log.checkpoint_every=2",
            config=f"configs/world/{config}",
        )
        with contextlib.suppress(Preempted):  # preempted in iteration 3, after the checkpoint of iteration 2
            build_trainer(cfg).fit(progress=lambda row: row["iteration"] == 3 and stop())
        for extra_file in ("metrics.jsonl",):
            (out / extra_file).unlink(missing_ok=True)
        shutil.rmtree(out / "samples", ignore_errors=True)
        print(case, sorted(p.name for p in out.rglob("*")))


if __name__ == "__main__":
    main()
