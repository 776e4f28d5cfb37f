"""``python -m jagg.launch`` (torchrun's agent with the CLI's exit statuses, issue 58): a job whose ranks stopped on
SIGTERM / SIGUSR1 exits 143 / 138, not torchrun's 1; a signal to the agent reaches every rank; any other failure
is one line naming the rank that failed first. The agent is torchrun's own; its workers are small scripts (the
CLI's own statuses are tested in tests/test_failure_edges.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from jagg.launch import exit_line
from jagg.ops.rundir import REPO_ROOT as ROOT

WORKER = """
import os, signal, sys, time
mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
if mode == "stop":  # every rank saved and stopped, as the CLI does on SIGTERM
    sys.exit(143)
if mode == "fail":  # rank 1 fails; rank 0 waits in a collective until the agent ends it
    if rank == 1:
        sys.exit(2)
    time.sleep(60)
if mode == "wait":  # stops on TERM / USR1 as the CLI does: records the signal, exits 128 + its number
    def stop(signum, frame):
        open(os.path.join(out, f"got{rank}"), "w").write(str(signum))
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, stop)
    open(os.path.join(out, f"ready{rank}"), "w").close()
    time.sleep(60)
"""


def _launch(tmp_path: Path, mode: str) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("PET_SIGNALS_TO_HANDLE", None)
    cmd = [sys.executable, "-m", "jagg.launch", "--standalone", "--nproc_per_node", "2", str(script), mode]
    return subprocess.Popen(
        [*cmd, str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _last_line(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=180)
    assert "Traceback" not in err, err
    return proc.returncode, err.strip().splitlines()[-1]


def _failure(exitcode: int, timestamp: int = 0):
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp)


def test_the_exit_status_is_the_ranks_stop_status_and_the_cause_is_the_first_other_failure():
    assert (
        exit_line({0: _failure(143), 1: _failure(-15)})[0] == 143
    )  # one saved, the other ended by the agent
    assert exit_line({0: _failure(138), 1: _failure(138)})[0] == 138
    status, line = exit_line({0: _failure(143, 1), 1: _failure(2, 2)})  # rank 0 stopped: not the cause
    assert status == 2 and "rank 1 failed first (exit code 2" in line
    status, line = exit_line({0: _failure(-9, 5), 1: _failure(-6, 3)})
    assert status == 134 and "rank 1 failed first (killed by SIGABRT" in line


@pytest.mark.drill
def test_ranks_that_stopped_give_their_status_not_torchruns_1(tmp_path):
    status, line = _last_line(_launch(tmp_path, "stop"))
    assert status == 143 and line == "jagg.launch: ranks 0, 1 stopped by a signal (exit status 143)"


@pytest.mark.drill
def test_a_failed_rank_is_named_in_one_line_with_its_status(tmp_path):
    status, line = _last_line(_launch(tmp_path, "fail"))
    assert status == 2 and line.startswith("jagg.launch: rank 1 failed first (exit code 2"), line


@pytest.mark.drill
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_to_the_agent_reaches_every_rank_and_is_its_status(tmp_path, sig):
    proc = _launch(tmp_path, "wait")
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(sig)
    status, line = _last_line(proc)
    assert status == 128 + sig and f"stopped by {sig.name}" in line, line
    assert [(tmp_path / f"got{r}").read_text() for r in range(2)] == [str(int(sig))] * 2
