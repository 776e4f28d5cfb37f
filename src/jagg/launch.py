"""``torchrun`` with the CLI's exit statuses: ``python -m jagg.launch [torchrun options] -m jagg.train ...``.

torchrun itself exits 1 with a ``ChildFailedError`` traceback whenever a worker exits non-zero, so a job stopped
by its scheduler (every rank saved, then exited 143 / 138: ``jagg.ops.signals``) reads as a crash, and it dies
of SIGUSR1 (its default action) without passing it on (torch.distributed.elastic handles TERM, INT, HUP and
QUIT only by default: torchrun ``--signals-to-handle``). This launcher runs torchrun's own agent
(``torch.distributed.run``: same options, same rendezvous) and ends as one process of the job would:

* every failed rank stopped by a signal (143 / 138, or killed by the agent's SIGTERM): that status, one line;
* the agent signalled (TERM / USR1 / INT / HUP / QUIT): it passes the signal on to its workers (which save) and
  exits 128 + the signal's number, one line;
* any other failure: one line naming the rank that failed first (torchrun's root cause) and how (its exit
  code, or the signal that killed it); the status is that rank's, 128 + signal where a signal killed it.
  The rank's own message is above, in its log.
"""

from __future__ import annotations

import os
import signal
import sys

from jagg.ops.signals import EXIT_STATUS

# The agent forwards these to its workers (torchrun's default plus SIGUSR1, a scheduler's warning before it
# kills the job); --signals-to-handle or PET_SIGNALS_TO_HANDLE set by the user is kept.
FORWARDED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _status(code: int) -> int:
    """A process's exit status as a shell reports it: 128 + the signal's number where a signal killed it."""
    return 128 - code if code < 0 else code


def exit_line(failures: dict) -> tuple[int, str]:
    """``(status, line)`` for torchrun's failed ranks (``{rank: ProcessFailure}``, ``exitcode`` negative where
    a signal killed the process). A rank that stopped on a signal (143 / 138), or that the agent's SIGTERM
    killed once another rank had failed, is not the cause when another rank failed otherwise."""
    stopped = {*EXIT_STATUS.values(), -int(signal.SIGTERM)}
    causes = {r: f for r, f in failures.items() if f.exitcode not in stopped}
    if not causes:  # every rank stopped as the CLI stops on TERM / USR1
        status = max(_status(f.exitcode) for f in failures.values())
        ranks = ", ".join(map(str, sorted(failures)))
        return status, f"jagg.launch: ranks {ranks} stopped by a signal (exit status {status})"
    rank = min(causes, key=lambda r: (causes[r].timestamp, r))  # torchrun's first failure (root cause)
    code = causes[rank].exitcode
    how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"
    return _status(code), (
        f"jagg.launch: rank {rank} failed first ({how}; its own message is above); "
        f"ranks failed: {', '.join(map(str, sorted(failures)))}"
    )


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", FORWARDED)  # torchrun --signals-to-handle's default
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as err:
        status, line = exit_line(err.failures)
        print(line, file=sys.stderr)
        return status
    except SignalException as err:
        status = 128 + int(err.sigval)
        print(
            f"jagg.launch: stopped by {_signal_name(int(err.sigval))}; passed on to every rank (exit status "
            f"{status})",
            file=sys.stderr,
        )
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
