"""``jagg.common`` plumbing: atomic writes keep the umask's permissions and are fsynced; run metadata records
the versions of every library that can change a number; a renamed keyword is still taken under its old name."""

from __future__ import annotations

import io
import json
import os
import stat

import pytest
import torch

from jagg import common
from jagg.common import (
    ProgressETA,
    atomic_write_text,
    format_seconds,
    run_metadata,
    write_table,
)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_write_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "run.json", "{}\n")
        write_table([{"a": 1}], tmp_path / "t.csv", {"seed": 0})
        with open(tmp_path / "plain.txt", "w") as f:  # what an ordinary write gives, for comparison
            f.write("x")
    finally:
        os.umask(old)
    for name in ("run.json", "t.csv", "t.meta.json", "plain.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    assert (tmp_path / "run.json").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.txt", "run.json", "t.csv", "t.meta.json"]


def test_atomic_write_fsyncs_file_and_directory(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(common.os, "fsync", fsync)
    atomic_write_text(tmp_path / "sub" / "x.txt", "hello")
    assert synced == ["file", "dir"]


def test_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "x.txt"
    atomic_write_text(path, "old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(common.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["x.txt"]


def test_run_metadata_records_every_relevant_version():
    meta = json.loads(json.dumps(run_metadata(seed=0)))
    v = meta["versions"]
    for pkg in (
        "python",
        "torch",
        "diffusers",
        "transformers",
        "peft",
        "open-clip-torch",
        "datasets",
        "numpy",
    ):
        assert v[pkg] not in ("", "missing"), pkg
    assert v["torch"] == torch.__version__.split("+")[0]
    assert ("cuda_build" in v) == (torch.version.cuda is not None)
    if torch.version.cuda is not None and torch.distributed.is_nccl_available():
        assert v["nccl"].count(".") == 2
    assert "accelerate" not in v  # not imported by jagg: not a version that can change a number


def test_progress_eta_from_the_mean_pace():
    now = [0.0]
    out = io.StringIO()
    eta = ProgressETA(4, "table1", stream=out, clock=lambda: now[0])
    now[0] = 10.0
    assert eta.step("flux dancegrpo iteration 1/4") == (
        "[1/4  25%] table1 flux dancegrpo iteration 1/4 | elapsed 10s | ETA 30s"
    )
    now[0] = 30.0
    assert eta.step().endswith("| elapsed 30s | ETA 30s")  # 15 s per unit so far, 2 left
    now[0] = 3700.0
    assert eta.step(n=2) == "[4/4 100%] table1 | elapsed 1h01m | ETA 0s"
    assert out.getvalue().count("\n") == 3
    assert [format_seconds(s) for s in (0, 59.4, 425, 3720)] == ["0s", "59s", "7m05s", "1h02m"]


def test_a_drivers_own_outputs_do_not_make_its_record_dirty_and_other_changes_are_recorded(tmp_path):
    """Issue 58: ``make table1`` rewrites its committed results; its meta must still name a clean commit, and
    an edit anywhere else must make it dirty with the diff recorded."""
    import subprocess

    from jagg.common import tree_state

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "table1.csv").write_text("a\n1\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = git("rev-parse", "HEAD").strip()
    (tmp_path / "results" / "table1.csv").write_text("a\n2\n")  # the driver's own output, rewritten
    assert tree_state(["results/table1*"], root=tmp_path) == (head, None)
    assert tree_state(root=tmp_path)[0] == head + "-dirty"  # without the exclusion it is dirty
    (tmp_path / "code.py").write_text("x = 2\n")
    sha, diff = tree_state(["results/table1*"], root=tmp_path)
    assert sha == head + "-dirty" and "+x = 2" in diff and "table1.csv" not in diff


def test_records_of_two_drivers_name_each_others_results_and_never_nest_them(tmp_path):
    """Issue 56: two protocols writing at once each found the other's uncommitted records dirty, and stored
    their diff, which held the first one's earlier record: the records doubled in size per run (2.2 MB at the
    fifth; a submission past the size limit). A generated file is named by blob id, its content never stored."""
    import json
    import subprocess

    from jagg.common import tree_state

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    for d in ("a", "b"):
        (tmp_path / "results" / d).mkdir(parents=True)
        (tmp_path / "results" / d / "run0.meta.json").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    sizes = []
    for i in range(1, 7):  # driver a, then b, alternately, each rewriting a tracked record of its own folder
        d = "ab"[i % 2]
        sha, diff = tree_state([f"results/{d}/**"], root=tmp_path)
        record = json.dumps({"git_sha": sha, "git_diff": diff, "payload": "r" * 1000})
        (tmp_path / "results" / d / "run0.meta.json").write_text(record + "\n")
        sizes.append(len(record))
    assert sha.endswith("-dirty") and sizes[-1] == sizes[1] < 1400, sizes  # bounded, not doubling
    other = "ab"[(i + 1) % 2]
    blob = git("hash-object", f"results/{other}/run0.meta.json").strip()
    assert diff == f"# uncommitted, not stored: results/{other}/run0.meta.json {blob}\n"
    (tmp_path / "code.py").write_text("x = 2\n")  # code is still stored whole, after the named results
    (tmp_path / "results" / other / "run0.meta.json").unlink()
    diff = tree_state([f"results/{d}/**"], root=tmp_path)[1]
    assert diff.startswith(f"# uncommitted, not stored: results/{other}/run0.meta.json deleted\n")
    assert "+x = 2" in diff and "payload" not in diff


def test_a_pattern_git_refuses_gives_an_unknown_state_never_a_clean_one(tmp_path):
    """A driver whose output lies outside the checkout must not silence the dirty check: git refuses the
    pathspec, and the record then says "unknown" instead of naming a clean commit."""
    import subprocess

    from jagg.common import tree_state

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"], cwd=tmp_path, check=True
    )
    (tmp_path / "code.py").write_text("x = 2\n")
    assert tree_state([str(tmp_path.parent / "elsewhere" / "*")], root=tmp_path) == ("unknown", None)
    assert tree_state(["results/*"], root=tmp_path)[0].endswith("-dirty")


def test_write_table_leaves_a_reproduced_result_and_its_record_alone(tmp_path):
    """Issue 58: a rerun that reproduces a committed table at another commit (``make figures``' memory plan)
    does not rewrite it, so it leaves no dirty file for the next driver's SHA; any other change rewrites both."""
    from jagg.common import write_table

    path = tmp_path / "t.csv"
    record = path.with_suffix(".meta.json")
    write_table([{"a": 1}], path, {"git_sha": "old", "config": {"k": 1}})
    kept = write_table([{"a": 1}], path, {"git_sha": "new", "git_diff": "d", "config": {"k": 1}})
    assert json.loads(record.read_text()) == kept == {"git_sha": "old", "config": {"k": 1}}  # same rows: kept
    write_table([{"a": 1}], path, {"git_sha": "new", "config": {"k": 2}})
    assert json.loads(record.read_text()) == {"git_sha": "new", "config": {"k": 2}}
    write_table([{"a": 2}], path, {"git_sha": "newer", "config": {"k": 2}})
    assert path.read_text() == "a\n2\n" and json.loads(record.read_text())["git_sha"] == "newer"
