"""Run a test function on N gloo ranks as real child processes (what the distributed tests use).

Why not ``torch.multiprocessing.spawn``: a rank that dies shows up there only as "process 1 terminated with
signal SIGABRT" (its Python traceback goes to an error queue that a crashing process may never flush), and
the tests used to rendezvous on a "free" TCP port probed by the parent, which another process can take
between the probe and rank 0's bind. Here:

* each rank is ``python tests/dist_harness.py MODULE:FUNCTION RANK WORLD OUT_DIR``, a plain subprocess
  whose stdout + stderr go to ``OUT_DIR/rank{r}.log``; if any rank fails, the error message contains every
  rank's exit status (signal name included) and the tail of its log;
* the ranks rendezvous through a ``file://`` store in ``OUT_DIR`` (no port at all);
* teardown is ordered: every rank reaches a barrier before ``destroy_process_group``, so no rank tears down
  its gloo connections while another is still communicating; what the function built is garbage-collected
  before that (not during interpreter shutdown); then each rank writes ``rank{r}.done`` and exits through
  the normal interpreter shutdown (a crash there still fails the test, with its log).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _describe(code: int | None) -> str:
    if code is None:
        return "still running (killed after the timeout)"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# A rank that dies of one of these signals crashed in native code (glibc's heap checks abort with
# "munmap_chunk(): invalid pointer"; seen once in gloo teardown under load): no assertion of the test ran. Such a
# launch is retried once, with a warning that carries the first attempt's logs; a second crash fails the test.
NATIVE_CRASHES = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)


def run_ranks(target: str, world: int, out_dir: str | os.PathLike, timeout: float = 600.0) -> Path:
    """Run ``target`` ("module:function", a module importable from tests/) as ``function(rank, out_dir)``
    on ``world`` gloo ranks; returns ``out_dir``. Raises AssertionError with every rank's status and log
    tail if a rank fails, hangs past ``timeout`` seconds, or exits without finishing its teardown (a launch in
    which a rank crashed in native code, ``NATIVE_CRASHES``, is retried once first)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report, crashed = _launch(target, world, out, timeout)
    if report and crashed:
        warnings.warn(f"{target}: a rank crashed in native code; retrying once\n{report}", stacklevel=2)
        report, _ = _launch(target, world, out, timeout)
    if report:
        raise AssertionError(report)
    return out


def _launch(target: str, world: int, out: Path, timeout: float) -> tuple[str | None, bool]:
    """One launch of the ranks: (None, False) if every rank finished, else (the failure report, whether a
    rank died of a ``NATIVE_CRASHES`` signal before the timeout)."""
    (out / "rendezvous.store").unlink(missing_ok=True)
    for r in range(world):
        (out / f"rank{r}.done").unlink(missing_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    procs, logs = [], []
    for rank in range(world):
        log = open(out / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [sys.executable, str(Path(__file__)), target, str(rank), str(world), str(out)]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):  # one rank failed: do not wait for the rest
                time.sleep(5.0)  # let the others fail with their own errors first
                break
            time.sleep(0.05)
    finally:
        codes = [p.poll() for p in procs]  # None: still running, killed below
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0 or not (out / f"rank{r}.done").exists()]
    if not failed:
        return None, False
    report = [f"{target} failed on rank(s) {failed}"]
    for r, code in enumerate(codes):
        tail = (out / f"rank{r}.log").read_text(errors="replace")[-4000:]
        report.append(f"--- rank {r}: {_describe(code)}; log tail:\n{tail}")
    crashed = any(c is not None and c < 0 and -c in {int(s) for s in NATIVE_CRASHES} for c in codes)
    return "\n".join(report), crashed


def save_rank_result(out_dir: str | os.PathLike, rank: int, result: dict, name: str = "rank") -> None:
    """A worker's result as ``OUT_DIR/{name}{rank}.json`` (what ``rank_results`` reads back)."""
    Path(out_dir, f"{name}{rank}.json").write_text(json.dumps(result, indent=1))


def rank_results(out_dir: str | os.PathLike, world: int, name: str = "rank") -> list[dict]:
    """Every rank's ``{name}{rank}.json``, in rank order."""
    return [json.loads(Path(out_dir, f"{name}{r}.json").read_text()) for r in range(world)]


def _rank_main(target: str, rank: int, world: int, out_dir: str) -> None:
    """One rank: rendezvous, run the function, barrier, destroy the process group, mark done."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = Path(out_dir) / "rendezvous.store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    module, func = target.split(":")
    getattr(importlib.import_module(module), func)(rank, out_dir)
    # Free what the function built (FSDP modules, DTensors and the gloo work objects they keep live in
    # reference cycles) while the interpreter is fully alive: collected during interpreter shutdown instead,
    # a tensor held by a finished gloo work object is destroyed without a usable Python runtime -> abort.
    gc.collect()
    dist.barrier()  # nobody tears down while another rank still communicates
    dist.destroy_process_group()
    gc.collect()
    (Path(out_dir) / f"rank{rank}.done").write_text("ok\n")


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
