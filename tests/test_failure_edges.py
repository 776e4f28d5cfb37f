"""Every expected failure of the CLI is one line, exit 2, no traceback, and nothing is written through a
symbolic link (issue 58): the drill's cases, run as a user runs them (a subprocess: its real stderr) where the
edge itself is the point, in-process elsewhere (an exception the edge missed would reach pytest)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jagg.config import TINY_OVERRIDES
from jagg.errors import ArtefactError
from jagg.ops.rundir import REPO_ROOT as ROOT
from jagg.train import main

TINY = [*TINY_OVERRIDES, "train.iterations=1", "train.prompts_per_iter=1", "train.images_per_prompt=2"]
TINY += ["train.train_batch_size=2", "sampling.num_steps=4", "log.eval_every=0"]
WORLD = str(ROOT / "configs" / "world" / "flux_dancegrpo.yaml")


def _cli(run: Path, *extra: str, config: str = WORLD) -> list[str]:
    return ["--config", config, *TINY, f"log.run_dir={run}", *extra]


def _process(argv: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    cmd = [sys.executable, "-m", "jagg.train", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def _one_line(proc: subprocess.CompletedProcess, status: int = 2) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == status and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def _hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 1-iteration run that each case copies."""
    run = tmp_path_factory.mktemp("edges") / "run"
    assert main(_cli(run)) == 0
    return run


def _copy(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    return run


# --------------------------------------------------------------------------- nothing written through a link
# one case per behaviour in make test, the others in make drill (subprocess runs: about a minute each)
@pytest.mark.parametrize(
    "name",
    [
        ".lock",
        pytest.param("run.json", marks=pytest.mark.drill),
        pytest.param("metrics.jsonl", marks=pytest.mark.drill),
    ],
)
def test_a_symlink_planted_where_the_run_writes_is_refused_and_its_target_untouched(trained, tmp_path, name):
    """``ln -s victim R/<name>``, then a resume: one line, exit 2, the victim byte for byte as it was (it holds
    the real file's content, so reading through the link succeeds and only the write can refuse)."""
    run = _copy(trained, tmp_path)
    victim = tmp_path / "victim"
    shutil.copy(run / name, victim) if (run / name).exists() else victim.write_text("someone's\n")
    before = _hash(victim)
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(victim)
    err = _one_line(_process(_cli(run, "--resume=auto", "train.iterations=2")))
    assert "symbolic link" in err and str(run / name) in err
    assert _hash(victim) == before and (run / name).is_symlink()


# --------------------------------------------------------------------------- one line before anything is written
@pytest.mark.parametrize(
    "config", ["flux_dancegrpo.yaml", pytest.param("wan_video.yaml", marks=pytest.mark.drill)]
)
def test_a_missing_world_artefact_with_a_tiny_backbone_is_one_line_before_any_write(tmp_path, config):
    """``model.source=tiny`` keeps the world's rewards, whose cached artefacts are missing: the same line as
    without it, and the run directory is not created (a retry needs no --overwrite)."""
    run = tmp_path / "run"
    argv = ["--config", str(ROOT / "configs" / "world" / config), "model.source=tiny", f"log.run_dir={run}"]
    err = _one_line(_process(argv, env={"JAGG_WORLD_CACHE": str(tmp_path / "no_cache")}))
    assert "world artefact" in err and "make pretrain" in err
    assert not run.exists()


def test_every_world_reward_names_the_artefacts_it_loads():
    """``REWARD_ARTEFACTS`` (what the CLI checks before writing) against the factories themselves: each built
    on an empty cache fails on exactly its first listed artefact; one that builds lists none."""
    import jagg.loop.rewards  # noqa: F401  (registers every reward)
    from jagg.rewards import REWARDS
    from jagg.world.rewards import REWARD_ARTEFACTS

    world = [n for n, f in REWARDS.items() if f.__module__.startswith("jagg.world.")]
    assert set(REWARD_ARTEFACTS) <= set(world)
    for name in world:
        kwargs = {"cache_dir": "/nonexistent"} if "cache_dir" in REWARDS[name].__code__.co_varnames else {}
        try:
            REWARDS[name](**kwargs)
        except ArtefactError as err:
            assert f"world artefact {REWARD_ARTEFACTS[name][0]!r} not found" in str(err), name
        else:
            assert name not in REWARD_ARTEFACTS


def test_a_run_json_whose_resumes_is_not_a_list_is_kept_and_the_resume_runs(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    meta = json.loads((run / "run.json").read_text())
    meta["resumes"] = "edited by hand"
    (run / "run.json").write_text(json.dumps(meta))
    assert main(_cli(run, "--resume=auto", "train.iterations=2")) == 0
    resumes = json.loads((run / "run.json").read_text())["resumes"]
    assert resumes[0] == {"earlier_record": "edited by hand"} and resumes[1]["config_changes"][
        "train.iterations"
    ] == [1, 2]
    assert "'resumes' was not a list" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("where", "code"), [("first write", errno.ENOSPC), ("unreadable metrics", errno.EACCES)]
)
def test_an_os_error_anywhere_is_one_line_naming_the_path_and_errno(
    trained, tmp_path, monkeypatch, capsys, where, code
):
    """The CLI's one edge: an ``OSError`` not expected by name (here injected, as root ignores permissions)
    is one line with the path and the errno's name, exit 2."""
    import jagg.ops.preflight as preflight
    import jagg.ops.rundir as rundir

    run = _copy(trained, tmp_path) if where == "unreadable metrics" else tmp_path / "fresh"
    target = rundir.MARKER if where == "first write" else "metrics.jsonl"

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(run / target))

    if where == "first write":
        monkeypatch.setattr(rundir, "write_marker", fail)
        argv = _cli(run)
    else:
        monkeypatch.setattr(preflight, "_metrics_rows", fail)
        argv = _cli(run, "--resume=auto", "train.iterations=2")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    if code == errno.ENOSPC:
        assert f"disk full while writing {run / target}" in err and " free on " in err, err
    else:
        assert f"cannot use {run / target}: Permission denied [EACCES]" in err, err


# --------------------------------------------------------------------------- messages that say what is true
def test_an_unreadable_run_json_is_not_called_corrupt_and_no_deletion_is_advised(
    trained, tmp_path, monkeypatch, capsys
):
    run = _copy(trained, tmp_path)
    read = Path.read_text

    def read_text(self, *args, **kwargs):  # permission denied (root ignores chmod, so injected)
        if self == run / "run.json":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return read(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    before = _hash(run / "run.json")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(_cli(run, "--resume=auto", "train.iterations=2"))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"cannot read {run / 'run.json'}: Permission denied [EACCES]" in err
    assert "corrupt" not in err.replace("not known to be corrupt", "") and "delete" not in err
    assert _hash(run / "run.json") == before


# --------------------------------------------------------------------------- signals at any moment
def _start(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "jagg.train", *argv]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def _handles(pid: int, signum: int) -> bool:
    """Whether process ``pid`` catches ``signum`` (``SigCgt`` in /proc/<pid>/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signum - 1) & 1)


@pytest.mark.parametrize(
    ("name", "after_s"),
    [
        ("SIGINT", 0.0),
        ("SIGINT", 0.3),
        ("SIGTERM", 0.0),
        pytest.param("SIGUSR1", 1.0, marks=pytest.mark.drill),
    ],
)
def test_a_signal_during_start_up_is_one_line_and_writes_nothing(tmp_path, name, after_s):
    """The drill's start-up window (imports, config, the model's build), from the CLI's first instruction
    (its handlers in place: SigCgt; before it only the interpreter's own start-up and runpy have run): Ctrl-C
    exits 130, TERM / USR1 143 / 138, each with one line and no traceback, and no run directory is left."""
    import signal
    import time

    run = tmp_path / "run"
    proc = _start(_cli(run))
    while not _handles(proc.pid, signal.SIGUSR1):  # the first instruction of jagg.train has run
        time.sleep(0.001)
    time.sleep(after_s)
    proc.send_signal(getattr(signal, name))
    out, err = proc.communicate(timeout=600)
    status = {"SIGINT": 130, "SIGTERM": 143, "SIGUSR1": 138}[name]
    _one_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), status)
    assert name in err or "SIGINT" in err
    assert not run.exists()


def _signal_in(monkeypatch, method: str, at: int) -> None:
    """Send SIGTERM to this process inside the trainer's ``method`` (a save, an evaluation) at iteration ``at``."""
    import signal

    from jagg.loop.trainer import Trainer

    original = getattr(Trainer, method)

    def with_signal(self, *args, **kwargs):
        if self.iteration == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, method, with_signal)


@pytest.mark.parametrize(
    ("phase", "method", "at", "rows"),
    [("save", "save_checkpoint", 1, [1]), ("first evaluation", "_evaluate_and_log", 0, [0])],
)
def test_a_stop_signal_during_a_save_or_an_evaluation_stops_at_the_end_of_that_phase(
    tmp_path, monkeypatch, capsys, phase, method, at, rows
):
    """Not after another iteration (a scheduler's grace period may not allow one): the save of iteration 1
    (checkpoint_every=1), or the evaluation before the first iteration, is the last thing the run does."""
    run = tmp_path / "run"
    extra = ["train.iterations=3", "log.checkpoint_every=1"] + (["log.eval_every=1"] if at == 0 else [])
    _signal_in(monkeypatch, method, at)
    assert main(_cli(run, *extra)) == 143
    logged = [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == rows, phase
    from jagg.ops.checkpoint import read_progress

    assert read_progress(run / "checkpoint")["iteration"] == at
    assert f"stopped by SIGTERM after iteration {at}" in capsys.readouterr().err


def test_a_dead_peer_is_one_line_naming_this_rank(tmp_path, monkeypatch, capsys):
    """What gloo raises in a collective when another rank's worker was killed ("Connection reset by peer"),
    injected where every rank meets its peers first (the run directory's lock), reaches the edge as one line."""
    import torch.distributed as dist

    import jagg.ops.rundir as rundir

    def lost(*args, **kwargs):
        raise dist.DistBackendError(
            "[../gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41: Connection reset by peer"
        )

    import jagg.distributed

    monkeypatch.setattr(rundir, "hold", lost)
    monkeypatch.setattr(
        jagg.distributed, "init_distributed", lambda **kwargs: None
    )  # rank 1 of 2, alone here
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(_cli(tmp_path / "run"))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert (
        "rank 1 of 2: another rank's process ended during a collective" in err and "Connection reset" in err
    )
