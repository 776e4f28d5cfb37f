"""Experiment trackers (``log.report_to``): the rows of metrics.jsonl and the sample grids, also to TensorBoard
and / or Weights & Biases.

    tensorboard   event files under ``<log.run_dir>/tensorboard/`` (``tensorboard --logdir runs/``): every
                  numeric field of a row as a scalar at step ``row["iteration"]``, the sample grid as an image,
                  the config as text
    wandb         ``wandb.init(project=$WANDB_PROJECT or "jagg", name=<run_dir name>, dir=<run_dir>)`` with the
                  same scalars and grids, and as its config the run's config plus ``git_sha``, ``hardware`` and
                  ``versions`` (``jagg.common.run_metadata``, as run.json). Mode: ``$WANDB_MODE`` when set; else
                  online when an API key is set up (``WANDB_API_KEY`` or ``wandb login``'s netrc entry), offline
                  otherwise (``wandb sync <run_dir>/wandb/offline-run-*`` uploads later). An optional extra:
                  ``pip install 'jagg[trackers]'`` (tested with wandb 0.31.0)

A resumed run (``--resume``, or ``--resume auto`` starting again) may redo iterations an earlier attempt logged.
Each tracker then shows the resumed trajectory, never the discarded one:

    tensorboard   the first event written after the resume is a ``SessionLog.START`` at the first step redone
                  (the checkpoint's iteration + 1; 0 when starting again), which makes TensorBoard drop the
                  earlier attempt's events from that step on (what ``SummaryWriter``'s ``purge_step`` does)
    wandb         a new wandb run linked to the old one: wandb keeps a run's steps increasing and drops any
                  step below the last one logged ("step X less than current step"), so the same run cannot
                  take the redone iterations. Each attempt is its own run (same name; the id of the newest in
                  ``<run_dir>/wandb_run_id``); a resumed one has ``resumed_from`` (the earlier run's id and the
                  checkpoint's iteration) in its config and notes, and starts by logging the checkpoint's rows
                  and their sample grids again, so the newest run alone holds the whole trajectory that
                  metrics.jsonl holds. wandb's own ways were not taken: ``resume_from`` (rewind) and
                  ``fork_from`` are in private preview on the hosted service, not available on self-managed
                  servers, and neither works offline, which is this project's default without an API key

Each tracker library is imported only when named (``jagg.ops.preflight`` checks that it is installed before
anything is written). Only rank 0 opens trackers; ``RunLog`` feeds them where it appends to metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import secrets
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
from torch import Tensor

from jagg.common import atomic_write_text, open_for_writing
from jagg.ops.grids import grid_array, save_grid


def scalars(row: dict, prefix: str = "") -> dict[str, float]:
    """The numeric fields of a metrics row, nested dicts flattened with "/" (bools, lists and strings left out)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, int | float) and not isinstance(value, bool) and key != "iteration":
            out[name] = float(value)
    return out


class TensorBoardTracker:
    """Scalars, grids and the config to ``<run_dir>/tensorboard`` (``torch.utils.tensorboard.SummaryWriter``)."""

    def __init__(self, run_dir: Path, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        earlier = any((run_dir / "tensorboard").glob("events.out.tfevents.*"))
        self.purge_from: int | None = 0 if earlier else None  # an earlier attempt logged: drop its steps
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def restart(self, rows: list[dict]) -> None:
        """A resume from the checkpoint whose rows are ``rows``: the steps after its last one are redone."""
        if self.purge_from is not None:
            self.purge_from = int(rows[-1]["iteration"]) + 1 if rows else 0

    def _purge(self) -> None:
        """Before the first event after a resume: TensorBoard drops earlier events from ``purge_from`` on."""
        if self.purge_from is None:
            return
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        start = Event(step=self.purge_from, session_log=SessionLog(status=SessionLog.START))
        self.writer._get_file_writer().add_event(start)
        self.purge_from = None

    def log_row(self, row: dict, step: int) -> None:
        self._purge()
        for name, value in scalars(row).items():
            if math.isfinite(value):
                self.writer.add_scalar(name, value, step)
        self.writer.flush()  # one row per iteration: a crashed run keeps every row it logged

    def log_grid(self, grid: np.ndarray, step: int) -> None:
        self._purge()
        self.writer.add_image("samples", grid, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Scalars, grids, the config and the run metadata to a wandb run (offline unless set up, see above); a new
    run for every attempt, linked to the previous one (module docstring)."""

    def __init__(self, run_dir: Path, config: dict) -> None:
        import wandb

        from jagg.common import run_metadata
        from jagg.ops.rundir import not_inputs

        self.wandb, self.run_dir = wandb, run_dir
        id_file = run_dir / "wandb_run_id"  # the newest attempt's run
        self.previous = id_file.read_text().strip() if id_file.is_file() else None
        run_id = secrets.token_hex(6)
        with open_for_writing(id_file) as f:
            f.write(run_id + "\n")
        meta = run_metadata(outputs=not_inputs(config.get("model", {}).get("source", "")))  # as run.json
        linked = {"resumed_from": {"wandb_run": self.previous, "iteration": 0}} if self.previous else {}
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "jagg"),
            name=run_dir.name,
            dir=str(run_dir),
            id=run_id,
            mode=None if os.environ.get("WANDB_MODE") else wandb_default_mode(),
            config={**config, **{k: meta[k] for k in ("git_sha", "hardware", "versions")}, **linked},
            notes=self._notes(0),
        )

    def _notes(self, iteration: int) -> str | None:
        if self.previous is None:
            return None
        return (
            f"resumed at iteration {iteration} from wandb run {self.previous}, whose steps after {iteration} "
            "were redone here; this run holds the whole trajectory"
        )

    def restart(self, rows: list[dict]) -> None:
        """A resume from the checkpoint whose rows are ``rows``: link this run to the checkpoint's iteration and
        log those rows (and the sample grids saved with them) again, so that this run holds them too."""
        iteration = int(rows[-1]["iteration"]) if rows else 0
        link = {"wandb_run": self.previous, "iteration": iteration}
        self.run.config.update({"resumed_from": link}, allow_val_change=True)
        if self.previous is not None:
            self.run.notes = self._notes(iteration)
        for row in rows:
            step = int(row["iteration"])
            self.log_row(row, step)
            grid = self.run_dir / "samples" / f"iter_{step:05d}.png"
            if grid.is_file():
                self.run.log({"samples": self.wandb.Image(str(grid))}, step=step)

    def log_row(self, row: dict, step: int) -> None:
        self.run.log(scalars(row), step=step)

    def log_grid(self, grid: np.ndarray, step: int) -> None:
        self.run.log({"samples": self.wandb.Image(grid)}, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_default_mode() -> str:
    """``online`` when a wandb API key is set up (``WANDB_API_KEY``, or the netrc entry ``wandb login`` writes
    for ``$WANDB_BASE_URL``'s host), else ``offline``: a run never stops to ask for a login."""
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        entry = None
    return "online" if entry and entry[2] else "offline"


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}  # keys: jagg.config.TRACKER_NAMES


class Trackers:
    """The run's trackers as one: each call goes to every tracker named in ``log.report_to`` (none: no-op)."""

    def __init__(self, names: list[str], run_dir: str | Path, config: dict) -> None:
        run_dir = Path(run_dir)
        if names:
            run_dir.mkdir(parents=True, exist_ok=True)
        self.trackers = [TRACKERS[name](run_dir, config) for name in names]

    def log_row(self, row: dict) -> None:
        for tracker in self.trackers:
            tracker.log_row(row, int(row["iteration"]))

    def restart(self, rows: list[dict]) -> None:
        """A resumed run goes on from the checkpoint whose rows are ``rows`` (each tracker's ``restart``)."""
        for tracker in self.trackers:
            tracker.restart(rows)

    def log_images(self, images: Tensor, step: int) -> None:
        """(B, 3, H, W) images in [0, 1] as the sample grid of ``save_grid`` (built only when a tracker is on)."""
        if self.trackers:
            grid = grid_array(images)
            for tracker in self.trackers:
                tracker.log_grid(grid, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


class RunLog:
    """What a run writes as it goes, on rank 0: metrics.jsonl (one row per iteration, appended), the trackers
    (``log.report_to``), and per evaluation the per-sample scores (``samples/eval_<it>.json``) and, every
    ``log.grid_every`` evaluations' iterations, the sample grid. Every rank keeps the rows (``rows``)."""

    def __init__(
        self, run_dir: Path, is_main: bool, report_to: list[str], config: dict, grid_every: int
    ) -> None:
        self.run_dir, self.is_main, self.grid_every = Path(run_dir), is_main, grid_every
        self.rows: list[dict] = []
        self.trackers = Trackers(report_to if is_main else [], self.run_dir, config)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        if self.is_main:
            with open_for_writing(self.run_dir / "metrics.jsonl", append=True) as f:
                f.write(json.dumps(row) + "\n")
            self.trackers.log_row(row)

    def restart(self, rows: list[dict]) -> None:
        """Continue from ``rows`` (a resumed checkpoint's): metrics.jsonl is rewritten to hold exactly them, and
        the trackers show them, not the iterations an earlier attempt logged after them (module docstring)."""
        self.rows = rows
        if self.is_main:
            atomic_write_text(self.run_dir / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in rows))
            self.trackers.restart(rows)

    def evaluation(self, it: int, per_sample: dict, images: Tensor) -> None:
        """The per-sample scores of the evaluation at iteration ``it`` and, when due, its sample grid."""
        if not self.is_main:
            return
        atomic_write_text(self.run_dir / "samples" / f"eval_{it:05d}.json", json.dumps(per_sample))
        if self.grid_every == 0 or it % self.grid_every == 0:
            save_grid(images, self.run_dir / "samples" / f"iter_{it:05d}.png")
            self.trackers.log_images(images, it)

    def close(self) -> None:
        self.trackers.close()
