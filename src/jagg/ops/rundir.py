"""The run directory: the marker that makes it one, the lock of its one writer, what ``--overwrite`` may
delete, and the temporaries a killed run leaves behind.

* ``MARKER`` (``.jagg_run``) is written when a fresh run starts; ``--overwrite`` deletes only a directory that
  holds it (or a ``run.json`` of this CLI, written before the marker existed) or is empty, holds nothing but
  what a run writes (``RUN_ENTRIES``: a forged marker does not make other files deletable), and is never the
  working directory, one of its ancestors, a git repository's root, the home directory or ``/``
  (``check_overwrite``).
* ``RunDirLock`` (``.lock``) is an exclusive ``flock`` on a file in the directory, taken by rank 0 before
  anything is written and held until the process ends. The kernel drops an ``flock`` when its process dies
  (kill -9 included), so a lock left by a crash is stale by construction; the file also records the holder's
  pid, host and command, which name it in the second writer's error, and are the fallback check (pid alive
  on this host) on a filesystem without ``flock``. ``hold`` gives every rank rank 0's outcome, and refuses a
  node that does not see rank 0's lock (``log.run_dir`` not shared).
* Where ``--export OUT`` may write is ``jagg.ops.exportdir``'s (it shares ``protected``).
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import json
import os
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from jagg.errors import ConfigError

MARKER = ".jagg_run"
LOCK = ".lock"
REPO_ROOT = Path(__file__).resolve().parents[3]
# Everything a run writes at the top of its directory (fnmatch patterns), and the code that writes it: the one
# list ``--overwrite`` deletes from (anything else there is not the project's, so it refuses), kept in step with
# the writers by a test that runs the CLI with every writer on.
RUN_ENTRIES = (
    MARKER,  # write_marker
    LOCK,  # RunDirLock
    "run.json",  # jagg.train._write_run_json
    "metrics.jsonl",  # jagg.ops.trackers.RunLog
    "samples",  # RunLog.evaluation (scores, grids), jagg.plugins.eval_state
    "checkpoint",  # jagg.ops.checkpoint: the checkpoint, a save in progress, the swap's and keep=2's
    "checkpoint.tmp",
    "checkpoint.old",
    "checkpoint.prev",
    "tensorboard",  # jagg.ops.trackers.TensorBoardTracker
    "wandb",  # jagg.ops.trackers.WandbTracker (its run, and the id a resume continues)
    "wandb_run_id",
    "hang_rank*.txt",  # jagg.ops.heartbeat.PhaseWatch
    "nccl_trace_rank_*",  # jagg.ops.node.cuda_run_env: the NCCL flight recorder's dumps
    ".*.tmp",  # jagg.common.atomic_write_text's temporaries, left by a kill
)


# --------------------------------------------------------------------------- what a run directory is
def not_inputs(source: str) -> tuple[str, ...]:
    """Tracked files a run's recorded SHA need not be clean of (``run_metadata(outputs=)``): on the world
    (``model.source``), `make pretrain`'s reports about it, which a rebuild rewrites and no run reads (the
    build a run loaded is recorded as ``world_build``)."""
    if source != "world":
        return ()
    from jagg.world.pretrained import REPORTS

    return REPORTS


def entries(run_dir: Path) -> list[Path]:
    """What the directory holds besides the lock file (a lock left by a killed run is no content)."""
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if p.name != LOCK)


def is_run_dir(run_dir: Path) -> bool:
    """The directory holds this project's marker, or a ``run.json`` of this CLI (runs from before the marker)."""
    if (run_dir / MARKER).is_file():
        return True
    try:
        meta = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and {"git_sha", "config", "argv"} <= set(meta)


def written_by_run(path: Path) -> bool:
    """Whether ``path`` (an entry of a run directory) is one a run writes (``RUN_ENTRIES``)."""
    return any(fnmatch.fnmatchcase(path.name, pattern) for pattern in RUN_ENTRIES)


def foreign_entries(run_dir: Path) -> list[Path]:
    """What ``run_dir`` holds that no run writes (someone else's files, or a forged marker's neighbours)."""
    return [p for p in entries(run_dir) if not written_by_run(p)]


def protected(path: Path) -> str | None:
    """Why ``path`` (resolved) may never be deleted, or None."""
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if path == cwd or path in cwd.parents:
        return "it is the working directory or one of its ancestors"
    if path == REPO_ROOT or path in REPO_ROOT.parents or (path / ".git").exists():
        return "it is a git repository's root or one of its ancestors"
    if path == home or path in home.parents:
        return "it is the home directory or one of its ancestors"
    return None


def check_overwrite(run_dir: Path) -> None:
    """``ConfigError`` (one line, saying why) unless ``--overwrite`` may delete what ``run_dir`` holds."""
    why = protected(run_dir.resolve())
    if why is None and entries(run_dir) and not is_run_dir(run_dir):
        why = f"it is not a run directory of this project (no {MARKER} marker, no run.json of this CLI)"
    foreign = foreign_entries(run_dir) if why is None else []
    if foreign:  # a marker is only a file: what the directory holds must be what a run writes too
        why = f"it holds {foreign[0].name!r}, which a run does not write (move it elsewhere first)"
    if why:
        raise ConfigError(
            f"--overwrite refuses to delete log.run_dir={run_dir}: {why}; choose another log.run_dir"
        )


def wipe(run_dir: Path) -> None:
    """Delete what a run wrote in the directory (``RUN_ENTRIES``), keeping the lock file of the run that is
    starting; anything else stays (``check_overwrite`` refuses such a directory; ``--resume auto``'s restart
    leaves it)."""
    for p in entries(run_dir):
        if not written_by_run(p):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def write_marker(run_dir: Path) -> None:
    from jagg.common import open_for_writing

    with open_for_writing(run_dir / MARKER) as f:
        f.write("a run directory of python -m jagg.train (--overwrite may delete it)\n")


def clean_stale(run_dir: Path) -> list[Path]:
    """Remove what a killed or failed save left: ``checkpoint.tmp/`` and ``.<name>.*.tmp`` files of
    ``atomic_write_text`` (under the lock no other writer can own them); returns what was removed."""
    stale = [run_dir / "checkpoint.tmp", *run_dir.glob(".*.tmp"), *run_dir.glob("samples/.*.tmp")]
    stale = [p for p in stale if p.exists()]
    for p in stale:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return stale


# --------------------------------------------------------------------------- one writer at a time
def _make_dirs(run_dir: Path) -> Path | None:
    """Create ``run_dir`` and its missing parents; the topmost directory created (None: it existed).
    ``ConfigError`` when it is a file, lies under a file or cannot be created."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"log.run_dir={run_dir} is a file, not a directory; choose another log.run_dir")
    missing = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    blocker = next((p for p in run_dir.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(
            f"log.run_dir={run_dir} lies under {blocker}, which is a file; choose another log.run_dir"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"log.run_dir={run_dir} cannot be created ({err.strerror})") from None
    return missing[-1] if missing else None


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks (``/proc/<pid>/stat`` field 22), None where unknown;
    with the pid it names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def holder_alive(holder: dict) -> bool:
    """Whether the recorded holder may still run: always on another host (it cannot be checked from here)."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = int(holder.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return holder.get("start") in (None, process_start(pid))


def describe(holder: dict) -> str:
    argv = " ".join(["python", *holder["argv"]]) if holder.get("argv") else "?"
    return (
        f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('time', '?')} ({argv})"
    )


class RunDirLock:
    """An exclusive lock on ``run_dir`` (module docstring): ``acquire`` or ``ConfigError`` naming the holder."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self.fd: int | None = None
        self.created: Path | None = None

    def _read_holder(self) -> dict:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _busy(self) -> ConfigError:
        return ConfigError(
            f"log.run_dir={self.run_dir} is in use by another training run ({describe(self._read_holder())}); "
            "wait for it to end or stop it, or choose another log.run_dir"
        )

    def acquire(self) -> None:
        self.created = _make_dirs(self.run_dir)
        try:
            self.fd = self._open_locked()
        except BaseException:
            self._remove_created()
            raise
        self._write_holder()

    def _open_locked(self) -> int:
        for _ in range(5):  # retried only when the file was replaced between this process's open and lock
            try:  # never through a symbolic link planted at .lock (it would overwrite the link's target)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as err:
                if err.errno == errno.ELOOP:
                    raise ConfigError(
                        f"log.run_dir={self.run_dir}: its lock file {self.path} is a symbolic link, never written "
                        "through; remove the link (it is not this project's) and start again"
                    ) from None
                raise ConfigError(f"log.run_dir={self.run_dir} is not writable ({err.strerror})") from None
            if self._lock(fd) and self._same_file(fd):
                return fd
            os.close(fd)
        raise self._busy()

    def _same_file(self, fd: int) -> bool:
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            return False

    def _lock(self, fd: int) -> bool:
        """``flock`` (False: another process holds it); without ``flock``, the recorded holder's pid."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            os.close(fd)
            raise self._busy() from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        holder = self._read_holder()
        if holder and holder_alive(holder) and holder.get("pid") != os.getpid():
            os.close(fd)
            raise self._busy()
        return True

    def _write_holder(self) -> None:
        holder = {
            "pid": os.getpid(),
            "start": process_start(os.getpid()),
            "host": socket.gethostname(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": sys.argv,
        }
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(self.fd)

    def release(self) -> None:
        """Delete the lock file (while still holding it) and the directories ``acquire`` created, if empty."""
        if self.fd is None:
            return
        try:
            if os.path.samestat(os.fstat(self.fd), os.stat(self.path)):
                self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        """Remove the empty directories this lock created (a run that failed before writing leaves nothing)."""
        if self.created is None:
            return
        for d in (self.run_dir, *self.run_dir.parents):
            try:
                d.rmdir()
            except OSError:
                break
            if d == self.created:
                break
        self.created = None


@contextmanager
def hold(run_dir: str | Path, dist, wait_s: float | None = None):
    """Rank 0 takes the run directory's lock for the whole block; every rank raises the same ``ConfigError``.

    Under several processes each other rank then reads the lock file rank 0 holds (``sees_lock``): a rank that
    does not find rank 0's holder there is on a node that does not share ``log.run_dir`` (a node-local disk),
    where its checkpoint shards would be out of the others' reach; every rank refuses, before anything is
    written."""
    lock = RunDirLock(run_dir) if dist.is_main else None
    error, holder = None, None
    if lock is not None:
        try:
            lock.acquire()
            holder = lock.path.read_text()
        except ConfigError as err:
            error = str(err)
    if dist.enabled:
        import torch.distributed

        shared = [error, holder]
        torch.distributed.broadcast_object_list(shared, src=0)
        error, holder = shared
        if error is None and not dist.is_main:
            error = sees_lock(run_dir, holder, SHARED_WAIT_S if wait_s is None else wait_s)
        error = dist.first_error(error)
    if error is not None:
        if lock is not None:
            lock.release()
        raise ConfigError(error)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


SHARED_WAIT_S = 10.0  # how long another node may take to see rank 0's lock file (NFS attribute caches)


def sees_lock(run_dir: str | Path, holder: str, wait_s: float = SHARED_WAIT_S) -> str | None:
    """None when ``run_dir``'s lock file holds ``holder`` (rank 0's, read back after locking), else the error
    of a node that does not share ``log.run_dir`` with rank 0; retried for ``wait_s`` seconds."""
    path, deadline = Path(run_dir) / LOCK, time.monotonic() + wait_s
    while True:
        try:
            if path.read_text() == holder:
                return None
        except OSError:
            pass
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    try:
        who = describe(json.loads(holder))
    except ValueError:
        who = "rank 0"
    return (
        f"log.run_dir={run_dir} on {socket.gethostname()} is not the directory rank 0 locked ({who}): a run on "
        "several nodes needs log.run_dir on a filesystem every node mounts (each rank writes its checkpoint "
        "shards there, rank 0 reads them all back)"
    )
