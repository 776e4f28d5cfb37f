"""Stopping on a scheduler's signal: finish the iteration, write a checkpoint, exit with a status that says so.

SLURM (and most schedulers) send SIGTERM, some SIGUSR1 (``--signal``), a grace period before SIGKILL. Inside
``stop_requests()`` those signals only set a flag (the first one wins); the CLI's ``before_iteration`` hook, which
``Trainer.fit`` calls before each iteration (after the previous one's evaluation and save), asks ``StopFlag.agreed`` (under torchrun one all-reduce,
so every rank stops after the same iteration) and raises ``StopRequested``; the CLI then writes the checkpoint,
finishes it and exits with ``EXIT_STATUS`` (128 + the signal's number, what a shell reports for a process the
signal killed: 143 for SIGTERM, 138 for SIGUSR1) and one line. SIGINT (Ctrl-C) is not caught here: the CLI
stops at once with one line and status ``SIGINT_STATUS`` (130), no traceback, no save.

From the first instruction: the CLI opens ``stop_requests`` for its whole run, so a signal during start-up
(imports, config, building the model) only sets the flag; before anything is written the CLI then exits with
one line (``stop_message``), and once training runs it stops before the next iteration, i.e. at the end of the
phase the signal arrived in (an iteration, an evaluation or a save), with a checkpoint.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_STATUS = {int(s): 128 + int(s) for s in STOP_SIGNALS}  # SIGTERM 143, SIGUSR1 138
SIGINT_STATUS = 128 + int(signal.SIGINT)  # 130


class StopRequested(Exception):
    """Raised after an iteration when a stop signal arrived; ``status`` is the exit status for it."""

    def __init__(self, signum: int, iteration: int) -> None:
        self.signum, self.iteration = signum, iteration
        self.name = signal.Signals(signum).name
        self.status = EXIT_STATUS.get(signum, 128 + signum)
        super().__init__(f"{self.name} received; stopping after iteration {iteration}")


class StopFlag:
    """The stop signal received (``signum``; None: none), set by the handlers ``stop_requests`` installs."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame) -> None:  # the handler: nothing but the flag
        if self.signum is None:
            self.signum = signum

    def agreed(self, dist=None) -> int | None:
        """The signal to stop for, the same on every rank (a collective under torchrun: a signal that reached
        one rank stops all of them after this iteration); None: go on."""
        signum = self.signum or 0
        if dist is not None and dist.enabled:
            signum = int(dist.reduce_scalars({"signum": float(signum)}, op="max")["signum"])
        return signum or None


_ACTIVE: StopFlag | None = None  # the flag whose handlers are installed (``stop_requests``), one per process


@contextmanager
def stop_requests(signals=STOP_SIGNALS):
    """Within the block the ``signals`` set the yielded ``StopFlag`` instead of ending the process; the previous
    handlers come back afterwards. Nested blocks share the outer block's flag (the CLI opens one for its whole
    run, from its first instruction, and the training loop's block reuses it). Off the main thread (where
    Python cannot install handlers) nothing changes."""
    global _ACTIVE
    if _ACTIVE is not None:
        yield _ACTIVE
        return
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {s: signal.signal(s, flag) for s in signals}
    _ACTIVE = flag
    try:
        yield flag
    finally:
        _ACTIVE = None
        for s, handler in previous.items():
            signal.signal(s, handler)


def install_early() -> StopFlag:
    """For a process that runs the CLI (``python -m jagg.train``): the stop signals set a flag from here on,
    for the life of the process; ``stop_requests`` blocks then share it."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = StopFlag()
        for s in STOP_SIGNALS:
            signal.signal(s, _ACTIVE)
    return _ACTIVE


def active_flag() -> StopFlag | None:
    """The flag the stop signals set now (None: they end the process as by default)."""
    return _ACTIVE


def stop_message(signum: int, what: str) -> str:
    """The one line of a stop before training started (``what``: what was and was not written)."""
    name = signal.Signals(signum).name
    return f"stopped by {name} {what} (exit status {EXIT_STATUS.get(signum, 128 + signum)})"
