"""The multi-process harness itself: a rank that dies fails the test with that rank's own error and status."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from dist_harness import run_ranks


def boom(rank: int, out_dir: str) -> None:
    """Rank 1 raises; rank 0 waits for it at a collective (and then fails too: its peer is gone)."""
    import torch.distributed as dist

    if rank == 1:
        with open(Path(out_dir) / "launches", "a") as f:
            f.write("1\n")
        raise RuntimeError("deliberate failure on rank 1")
    dist.barrier()


def abort(rank: int, out_dir: str) -> None:
    """Rank 1 dies by a signal, as a C++ std::terminate would (SIGABRT)."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGABRT)


def abort_once(rank: int, out_dir: str) -> None:
    """Rank 1 dies by SIGABRT in the first launch only (a crash in native code that does not recur)."""
    marker = Path(out_dir) / "crashed_once"
    if rank == 1 and not marker.exists():
        marker.write_text("1")
        os.kill(os.getpid(), signal.SIGABRT)


def test_a_failing_rank_shows_its_traceback(tmp_path):
    with pytest.raises(AssertionError) as err:
        run_ranks("test_dist_harness:boom", 2, tmp_path, timeout=120)
    text = str(err.value)
    assert "rank 1: exit code 1" in text
    assert "RuntimeError: deliberate failure on rank 1" in text  # the rank's own traceback, from its log
    assert (tmp_path / "launches").read_text() == "1\n"  # an error of the test's own is not retried


def test_a_rank_killed_by_a_signal_is_named(tmp_path):
    with pytest.raises(AssertionError) as err:
        run_ranks("test_dist_harness:abort", 2, tmp_path, timeout=120)
    assert "rank 1: killed by signal SIGABRT" in str(err.value)


def test_a_native_crash_is_retried_once_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="crashed in native code; retrying once") as w:
        run_ranks("test_dist_harness:abort_once", 2, tmp_path, timeout=120)
    assert "rank 1: killed by signal SIGABRT" in str(w[0].message)  # the first attempt's report
    assert all((tmp_path / f"rank{r}.done").exists() for r in range(2))
