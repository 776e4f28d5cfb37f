"""``--export`` deletes only what it wrote (issue 58): the swap of ``jagg.ops.exportdir`` under writers that
race it at each step, forged markers, and what a killed export leaves; plain files, no model."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jagg.errors import ConfigError
from jagg.ops import exportdir
from jagg.ops.exportdir import EXPORT_MARKER, check_export_target, clean_leftovers, export_tmp, place_export


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` (links not followed) with its bytes' hash."""
    out = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        if p.is_symlink():
            out[key] = "-> " + str(p.readlink())
        elif p.is_dir():
            out[key] = "dir"
        else:
            out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _export(out: Path, run: Path, content: str = "weights") -> Path:
    """A finished export of two files (one in a sub-folder, as Wan2.2's second expert) placed at ``out``."""
    tmp = export_tmp(out)
    (tmp / "model.safetensors").write_text(content)
    (tmp / "transformer_2").mkdir()
    (tmp / "transformer_2" / "model.safetensors").write_text(content + " 2")
    return place_export(tmp, out, run)


@pytest.fixture
def where(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    return tmp_path / "exports" / "out", run


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


def test_the_marker_records_each_files_size_and_hash(where):
    out, run = where
    _export(out, run)
    files = json.loads((out / EXPORT_MARKER).read_text())["files"]
    assert sorted(files) == ["model.safetensors", "transformer_2/model.safetensors"]
    for name, rec in files.items():
        data = (out / name).read_bytes()
        assert rec == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _export(out, run, "new weights")  # an intact earlier export is replaced
    assert (out / "model.safetensors").read_text() == "new weights" and _siblings(out) == []


@pytest.mark.parametrize("earlier", ["an earlier export", "empty"])
def test_a_file_written_into_out_after_the_last_check_is_never_deleted(where, monkeypatch, earlier):
    """The drill's race: a writer adds a file to OUT between the export's last check and its swap."""
    out, run = where
    if earlier == "empty":
        out.mkdir(parents=True)
    else:
        _export(out, run)
    mark = exportdir._mark

    def mark_then_race(tmp):
        mark(tmp)
        (out / "theirs.txt").write_text("not the export's")

    monkeypatch.setattr(exportdir, "_mark", mark_then_race)
    before = None
    with pytest.raises(
        ConfigError,
        match="it holds 'theirs.txt', (which the earlier export there did not|written there meanwhile)",
    ):
        tmp = export_tmp(out)
        (tmp / "model.safetensors").write_text("new")
        before = _tree(out.parent)
        place_export(tmp, out, run)
    assert (out / "theirs.txt").read_text() == "not the export's"
    after = _tree(out.parent)
    assert {k: v for k, v in after.items() if "theirs" not in k} == {
        k: v for k, v in before.items() if ".export.tmp" not in k
    }
    assert _siblings(out) == []  # the temporary removed, the earlier export put back in place


def test_an_earlier_export_edited_since_is_kept_whole(where, monkeypatch):
    """A listed file whose bytes changed (same size: only the hash, checked after the move aside, sees it)."""
    out, run = where
    _export(out, run)
    (out / "model.safetensors").write_text("WEIGHTS")  # same size, other bytes
    before = _tree(out)
    check_export_target(out, run)  # sizes agree: the cheap early check cannot tell
    tmp = export_tmp(out)
    (tmp / "model.safetensors").write_text("new")
    with pytest.raises(ConfigError, match="'model.safetensors' differs from what the earlier export wrote"):
        place_export(tmp, out, run)
    assert _tree(out) == before and _siblings(out) == []


def test_a_file_written_into_the_moved_export_after_its_check_survives(where, monkeypatch, caplog):
    out, run = where
    _export(out, run)
    check = exportdir.unverified

    def check_then_race(root, files, *, hashes):
        why = check(root, files, hashes=hashes)
        if hashes:  # the authoritative check, on the folder moved aside; a writer holding it adds a file
            (root / "transformer_2" / "theirs.txt").write_text("not the export's")
        return why

    monkeypatch.setattr(exportdir, "unverified", check_then_race)
    _export(out, run, "new weights")
    assert (out / "model.safetensors").read_text() == "new weights"
    [aside] = _siblings(out)
    assert aside.endswith(".export.old") and _tree(out.parent / aside) == {
        "transformer_2": "dir",
        "transformer_2/theirs.txt": hashlib.sha256(b"not the export's").hexdigest(),
        EXPORT_MARKER: _tree(out.parent / aside)[EXPORT_MARKER],
    }
    assert "theirs.txt" in caplog.text and aside in caplog.text
    clean_leftovers(out)  # the next export's clean-up keeps it too
    assert (out.parent / aside / "transformer_2" / "theirs.txt").is_file()


def _forge(out: Path, how: str) -> None:
    out.mkdir(parents=True)
    for i in range(3):
        (out / f"precious_{i}.txt").write_text(f"file {i}\n")
    (out / "folder").mkdir()
    (out / "folder" / "inside.txt").write_text("inside\n")
    listed = ["precious_0.txt", "precious_1.txt", "precious_2.txt", "folder"]
    if how == "list of names":  # the old format, or a hand-written marker
        (out / EXPORT_MARKER).write_text(json.dumps({"files": listed}))
    elif how == "symlinked marker":
        real = out.parent / "real_marker.json"
        real.write_text(json.dumps({"files": {n: {"bytes": 7, "sha256": "0" * 64} for n in listed[:3]}}))
        (out / EXPORT_MARKER).symlink_to(real)
    elif how == "wrong hashes":  # the right sizes, so only the hashes can tell
        files = {f"precious_{i}.txt": {"bytes": 7, "sha256": "0" * 64} for i in range(3)}
        files["folder/inside.txt"] = {"bytes": 7, "sha256": "0" * 64}
        (out / EXPORT_MARKER).write_text(json.dumps({"files": files}))
    elif how == "a listed folder":
        files = {n: {"bytes": 7, "sha256": "0" * 64} for n in listed}
        (out / EXPORT_MARKER).write_text(json.dumps({"files": files}))
    elif how == "paths outside":
        files = {"../run/victim.txt": {"bytes": 7, "sha256": "0" * 64}}
        (out / EXPORT_MARKER).write_text(json.dumps({"files": files}))


@pytest.mark.parametrize(
    "how", ["list of names", "symlinked marker", "wrong hashes", "a listed folder", "paths outside"]
)
def test_a_forged_marker_makes_nothing_deletable(where, how):
    out, run = where
    (run / "victim.txt").write_text("victim\n")
    _forge(out, how)
    before = _tree(out.parent)
    tmp = export_tmp(out)
    (tmp / "model.safetensors").write_text("new")
    with pytest.raises(ConfigError, match=f"--export refuses OUT={out}: "):
        place_export(tmp, out, run)
    assert _tree(out.parent) == before


@pytest.mark.parametrize(
    "name",
    ["checkpoint.tmp", "checkpoint.prev", "checkpoint.old", "samples", "samples/mine", "tensorboard/x"],
)
def test_out_inside_the_run_directory_is_refused(where, name):
    out, run = where
    with pytest.raises(ConfigError, match="inside the run directory"):
        check_export_target(run / name, run)


def test_an_empty_out_is_refused_and_tilde_is_the_home_directory(where, monkeypatch):
    out, run = where
    with pytest.raises(ConfigError, match="--export needs a directory name"):
        check_export_target("", run)
    monkeypatch.setenv("HOME", str(out.parent / "home"))
    (out.parent / "home").mkdir(parents=True)
    monkeypatch.chdir(out.parent)
    tmp = export_tmp("~/x")
    (tmp / "model.safetensors").write_text("w")
    assert place_export(tmp, "~/x", run) == out.parent / "home" / "x"
    assert (out.parent / "home" / "x" / "model.safetensors").is_file() and not (out.parent / "~").exists()


def test_leftovers_of_a_killed_export_are_removed_by_the_next(where):
    out, run = where
    _export(out, run)
    # a killed export: its temporary (writer dead) and an earlier export moved aside, not yet deleted
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    killed = export_tmp(out)
    (killed / "half_written.safetensors").write_text("half")
    holder = json.loads((killed / exportdir.TMP_HOLDER).read_text())
    (killed / exportdir.TMP_HOLDER).write_text(json.dumps({**holder, "pid": int(dead.stdout), "start": None}))
    aside = out.with_name(f".{out.name}.killed.export.old")
    os.rename(out, aside)
    live = export_tmp(out)  # another export still writing: its temporary stays
    (live / "model.safetensors").write_text("in progress")
    foreign = out.parent / f".{out.name}.someone.export.tmp"  # no writer record: not ours
    foreign.mkdir()
    (foreign / "theirs.txt").write_text("theirs")
    _export(out, run, "new weights")
    assert sorted(_siblings(out)) == sorted([live.name, foreign.name])
    assert (foreign / "theirs.txt").is_file() and (live / "model.safetensors").is_file()


@pytest.mark.parametrize("at", ["marker"])
def test_written_files_are_not_followed_through_symlinks(tmp_path, at):
    """The export marker is created fresh in the temporary (O_EXCL | O_NOFOLLOW): a link planted there is refused."""
    victim = tmp_path / "victim.txt"
    victim.write_text("victim\n")
    out, run = tmp_path / "out", tmp_path / "run"
    run.mkdir()
    tmp = export_tmp(out)
    (tmp / "model.safetensors").write_text("w")
    if at == "marker":
        (tmp / EXPORT_MARKER).symlink_to(victim)
        with pytest.raises(FileExistsError):
            place_export(tmp, out, run)
        assert victim.read_text() == "victim\n" and not out.exists()
