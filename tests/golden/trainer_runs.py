"""Golden runs of the training loop: what a 3-iteration tiny run of every world config writes, recorded once.

``python tests/golden/trainer_runs.py`` writes ``trainer_runs.json`` beside this file: for every case (each world
config, plus the plug-ins and calibrators switched on where no config does), the metrics rows without timings and
a digest of the checkpoint's tensors (one sha256 over all of them, and per part the float64 sum and sum of squares). It was run on the trainer
before the plug-in refactor; ``tests/test_golden_runs.py`` reruns each case and asserts the rows and the tensors
are bitwise equal. A refactor that changes no behaviour must keep them so.

Float kernels differ between CPU models and instruction sets, so bitwise equality is asserted where the recorded
``cpu`` (model and torch's kernel instruction set, which ``make`` pins to AVX2) matches this machine's; elsewhere
the cases are skipped with both named (the per-part sums and sums of squares stay in the recording for a reader).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
OUT = HERE / "trainer_runs.json"
TIME_KEYS = ("time_", "peak_memory")

# 3 iterations of the loop tests' tiny run (tests/helpers.py LOOP_RUN), evaluated at 0 and 3, checkpointed at 3
GOLDEN_RUN = ("train.iterations=3", "log.eval_every=3", "log.eval_prompts=2", "log.checkpoint_every=0")
WORLD_CONFIGS = sorted(p.name for p in (ROOT / "configs" / "world").glob("*.yaml"))
EXTRA = {  # the instruments and calibrators, each where the loop reaches it
    "fidelity_control_fixed": ("flux_dancegrpo.yaml", ["log.fidelity_every=2", "train.control_cosine=0.8"]),
    "control_fresh": ("flux_dancegrpo.yaml", ["train.control_cosine=0.5", "train.control_direction=fresh"]),
    "eval_state": ("qwenimage_dancegrpo.yaml", ["log.save_eval_state=true", "log.fidelity_every=1"]),
    "groups_auto": ("flux_dancegrpo.yaml", ["backward.jagg_frac=auto", "backward.calibrate_every=2"]),
    "group_size_auto": (
        "flux_dancegrpo.yaml",
        ["backward.jagg_frac=auto", "backward.group_size=auto", "backward.group_sizes=[2, 3]"],
    ),
    "knots_auto": ("flux_dancegrpo_knots.yaml", ["backward.placement=auto", "backward.calibrate_every=2"]),
    "windows_auto": ("flux_mixgrpo.yaml", ["backward.jagg_frac=auto", "backward.calibrate_every=2"]),
    "stored_outputs": ("flux_flowgrpo_fast.yaml", ["backward.reuse_rollout=true", "log.fidelity_every=1"]),
}


NEEDS = {  # what a config needs on top of the tiny run: the authors' blocks of 4 need 4k + 1 steps
    "curves_flux_authors.yaml": ["sampling.num_steps=9"],
    "flux_dancegrpo_authors.yaml": ["sampling.num_steps=9"],
    "qwenimage_dancegrpo_authors.yaml": ["sampling.num_steps=9"],
}


def cases() -> dict[str, tuple[str, list[str]]]:
    out = {name[:-5]: (name, NEEDS.get(name, [])) for name in WORLD_CONFIGS}
    return out | EXTRA


def digest(tensors: dict[str, torch.Tensor]) -> dict:
    """One sha256 over every tensor's name, dtype, shape and bytes (sorted by name), and per part (``model``,
    ``ema``, ``optimizer``) the float64 sum and norm (the comparison across CPU models)."""
    h, parts = hashlib.sha256(), {}
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(tensors[name].shape)}|".encode())
        h.update((t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)).numpy().tobytes())
        part = parts.setdefault(name.split(".")[0], {"count": 0, "sum": 0.0, "sq": 0.0})
        d = t.double()
        part["count"] += 1
        part["sum"] += float(d.sum())
        part["sq"] += float((d * d).sum())
    return {"sha256": h.hexdigest(), "parts": parts}


def strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIME_KEYS)}


def run_case(config: str, extra: list[str], run_dir: Path) -> dict:
    """Train the case in ``run_dir``; its rows (no timings) and checkpoint tensor digests."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import build_trainer, tiny_config
    from jagg.ops.checkpoint import find_checkpoint, read_checkpoint

    cfg = tiny_config(run_dir, *GOLDEN_RUN, *extra, config=f"configs/world/{config}")
    trainer = build_trainer(cfg)
    rows = [strip(r) for r in trainer.fit()]
    tensors = read_checkpoint(find_checkpoint(run_dir))
    return {
        "rows": json.loads(json.dumps(rows)),
        "tensors": digest(tensors),
    }


def machine() -> str:
    """The CPU model and the instruction set torch's kernels use: what decides bitwise equality."""
    from jagg.common import cpu_model

    return f"{cpu_model()} / {torch.backends.cpu.get_cpu_capability()}"


def main() -> None:
    torch.set_num_threads(1)
    out = {"cpu": machine(), "torch": torch.__version__, "run": list(GOLDEN_RUN), "cases": {}}
    for name, (config, extra) in cases().items():
        tmp = Path(tempfile.mkdtemp())
        try:
            out["cases"][name] = {"config": config, "overrides": extra, **run_case(config, extra, tmp)}
        finally:
            shutil.rmtree(tmp)
        print(name, out["cases"][name]["tensors"]["sha256"][:12], flush=True)
    OUT.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
