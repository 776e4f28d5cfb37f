"""Per-phase heartbeats and timeouts: a hung rank says where it is, and leaves every thread's stack behind.

The trainer names the phase it enters (``rollout``, ``reward``, ``calibrate``, ``update``, ``evaluate``,
``checkpoint``) with ``PhaseWatch.enter``; while ``fit`` runs, a daemon thread of this rank

    * logs ``heartbeat rank r: <phase> (iteration i) for N s`` every ``log.heartbeat_s`` seconds the same phase
      lasts (with the CUDA memory allocated on a GPU), so interleaved rank-tagged logs show which rank is stuck
      in which phase while the others wait in a collective;
    * once a phase has lasted ``log.phase_timeout_s`` seconds, logs a warning and appends the Python stack of
      every thread (``faulthandler``) to ``log.run_dir/hang_rank<r>.txt``, once per phase entry. It does not
      stop the run: the process group's own timeout (``train.dist_timeout_s``) does that, after the NCCL flight
      recorder has dumped each rank's last collectives (``jagg.ops.node``).

0 switches either off. Phases shorter than ``heartbeat_s`` log nothing.
"""

from __future__ import annotations

import faulthandler
import logging
import socket
import threading
import time
from pathlib import Path

import torch

from jagg.common import open_for_writing

log = logging.getLogger("jagg.heartbeat")
TICK_S = 5.0  # how often the thread looks (shorter when the configured periods are shorter)


class PhaseWatch:
    """This rank's current phase and the thread that reports on it (module docstring)."""

    def __init__(self, rank: int, heartbeat_s: float, timeout_s: float, dump_dir: str | Path) -> None:
        self.rank, self.heartbeat_s, self.timeout_s = rank, float(heartbeat_s), float(timeout_s)
        self.dump_path = Path(dump_dir) / f"hang_rank{rank}.txt"
        self.phase: str | None = None
        self.iteration = 0
        self.since = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats = 0
        self._dumped = False

    def enter(self, phase: str, iteration: int) -> None:
        """This rank starts ``phase`` of ``iteration`` now (the previous phase ends)."""
        with self._lock:
            self.phase, self.iteration, self.since = phase, iteration, time.monotonic()
            self._beats, self._dumped = 0, False

    def start(self) -> None:
        """Start the reporting thread (idempotent); nothing when both periods are 0."""
        if self._thread is not None or (self.heartbeat_s <= 0 and self.timeout_s <= 0):
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"jagg-heartbeat-{self.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and forget the phase."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread, self.phase = None, None

    def _run(self) -> None:
        periods = [p for p in (self.heartbeat_s, self.timeout_s) if p > 0]
        tick = min([TICK_S, *(p / 4 for p in periods)])
        while not self._stop.wait(tick):
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """Log a heartbeat and dump the stacks when due (called by the thread; callable directly in tests)."""
        with self._lock:
            if self.phase is None:
                return
            phase, it, elapsed = self.phase, self.iteration, now - self.since
            beat = self.heartbeat_s > 0 and elapsed >= (self._beats + 1) * self.heartbeat_s
            dump = self.timeout_s > 0 and elapsed >= self.timeout_s and not self._dumped
            self._beats += int(beat)
            self._dumped |= dump
        where = f"rank {self.rank}: {phase} (iteration {it}) for {elapsed:.0f} s"
        if beat:
            log.info(f"heartbeat {where}{_cuda_memory()}")
        if dump:
            self._dump(where)

    def _dump(self, where: str) -> None:
        log.warning(
            f"{where}, past log.phase_timeout_s={self.timeout_s:g}: every thread's stack -> {self.dump_path}"
        )
        try:
            self.dump_path.parent.mkdir(parents=True, exist_ok=True)
            with open_for_writing(self.dump_path, append=True) as f:
                # the host: on several nodes the file (global rank, shared run directory) says which machine
                f.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {socket.gethostname()} {where}\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as err:  # the run directory is gone or full: the warning above still says where
            log.warning(f"could not write {self.dump_path}: {err}")


def _cuda_memory() -> str:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ""
    return f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated"
