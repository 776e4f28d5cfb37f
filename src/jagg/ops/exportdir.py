"""Where ``--export OUT`` may write, and the swap that puts a finished export there without deleting anything
it did not write, under races and forged markers.

* ``EXPORT_MARKER`` (``.jagg_export``) records every file an export wrote, by path relative to ``OUT``, with
  its size and SHA-256 (``{"files": {path: {"bytes": n, "sha256": hex}}}``, the checkpoint manifest's form,
  ``jagg.ops.checkpoint.MANIFEST``). A marker that does not record them (a hand-written one, an older
  version's list of names), or a symbolic link in its place, makes nothing deletable.
* ``check_export_target``: ``OUT`` is absent, an empty directory or an earlier export holding nothing its
  marker does not list at the recorded sizes; never empty, ``.``, ``..``, a symbolic link, inside the run
  directory or holding it, the working directory, a git root or the home directory; ``~`` is expanded.
* ``export_tmp`` writes into a new hidden directory beside ``OUT`` (``.OUT.<random>.export.tmp``, mode 0700)
  holding ``TMP_HOLDER``, its writer's pid / start time / host; ``place_export`` marks it and renames it to
  ``OUT``: one ``rename(2)`` when ``OUT`` is absent or empty (the kernel refuses a non-empty target), else the
  earlier export is first moved aside (``.OUT.<random>.export.old``), checked there byte for byte against
  its marker, and then either deleted file by file (each hashed again just before its unlink; folders removed
  only when empty) or, when anything differs or is not listed, renamed back and the export refused. A file
  written into the old export after the check survives in the aside folder, which is named in a warning.
* ``clean_leftovers``: what a killed export left beside ``OUT`` is removed by the next export to it: aside
  folders by the same verified deletion, temporary folders when their writer is no longer alive.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

from jagg.errors import ConfigError
from jagg.ops.rundir import holder_alive, process_start, protected

log = logging.getLogger(__name__)

EXPORT_MARKER = ".jagg_export"
TMP_HOLDER = ".jagg_export_writer"
_TMP, _OLD = ".export.tmp", ".export.old"
_NAME_MAX, _SIBLING_EXTRA = 255, 21  # a file name's bytes (ext4, xfs, tmpfs); '.' + OUT + '.<8>.export.tmp'


def export_path(out: str | Path) -> Path:
    """``OUT`` as given on the command line, ``~`` expanded; ``ConfigError`` for an empty one."""
    if str(out).strip() == "":
        raise ConfigError("--export needs a directory name (got an empty OUT); e.g. --export exports/my_run")
    return Path(os.path.expanduser(str(out)))


# --------------------------------------------------------------------------- files, read without following links
def file_record(path: Path) -> dict:
    """``{"bytes": size, "sha256": hex}`` of the regular file ``path`` (``ELOOP`` for a symbolic link)."""
    h, size = hashlib.sha256(), 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": h.hexdigest()}


def _regular_files(root: Path) -> list[str]:
    """Every regular file under ``root`` (relative, '/'-separated); symbolic links are neither listed nor
    followed."""
    out = []
    for top, _dirs, files in os.walk(root):  # os.walk does not descend into linked folders
        rel = Path(top).relative_to(root)
        out += [(rel / f).as_posix() for f in files if not os.path.islink(os.path.join(top, f))]
    return sorted(out)


def listing(out: Path) -> dict[str, dict] | None:
    """The files ``out``'s marker records with their sizes and hashes; None when there is no such marker
    (absent, a symbolic link, unreadable, or without a size and hash for every path; paths must stay inside)."""
    try:
        fd = os.open(out / EXPORT_MARKER, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            files = json.loads(f.read(1 << 24))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(files, dict):
        return None
    for name, rec in files.items():
        parts = Path(name).parts
        if (
            not parts
            or Path(name).is_absolute()
            or any(p in ("", ".", "..") for p in parts)
            or name == EXPORT_MARKER
        ):
            return None
        if not (
            isinstance(rec, dict) and isinstance(rec.get("bytes"), int) and isinstance(rec.get("sha256"), str)
        ):
            return None
    return files


def unverified(out: Path, files: dict[str, dict], *, hashes: bool) -> str | None:
    """Why ``out`` is not exactly the export its marker records (an entry it does not list, a symbolic link,
    a size or, with ``hashes``, a SHA-256 that differs), or None."""
    listed_dirs = {p.as_posix() for name in files for p in Path(name).parents if p != Path(".")}
    for top, dirs, names in os.walk(out):
        rel = Path(top).relative_to(out)
        for d in dirs:
            key = (rel / d).as_posix()
            if os.path.islink(os.path.join(top, d)):
                return f"it holds {key!r}, a symbolic link the earlier export did not write"
            if key not in listed_dirs:
                return f"it holds {key!r}, which the earlier export there did not write"
        for n in names:
            key, path = (rel / n).as_posix(), Path(top) / n
            if key == EXPORT_MARKER:
                continue
            if key not in files or path.is_symlink() or not path.is_file():
                return f"it holds {key!r}, which the earlier export there did not write"
            if path.stat().st_size != files[key]["bytes"]:
                return f"{key!r} differs in size from what the earlier export wrote (changed since)"
            if hashes and file_record(path)["sha256"] != files[key]["sha256"]:
                return f"{key!r} differs from what the earlier export wrote (its SHA-256 changed)"
    return None


def remove_verified(root: Path, files: dict[str, dict]) -> list[str]:
    """Delete what the marker records under ``root``, each file only if it still has the recorded size and
    hash, then the marker and the folders left empty; returns what was kept (not ours, or changed)."""
    kept = []
    for name in sorted(files):
        path = root / name
        try:
            if path.is_symlink() or file_record(path) != files[name]:
                kept.append(name)
                continue
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError:
            kept.append(name)
    others = [n for n in _regular_files(root) if n != EXPORT_MARKER and n not in files]
    if not kept and not others:
        (root / EXPORT_MARKER).unlink(missing_ok=True)
    for top, _dirs, _names in sorted(os.walk(root, topdown=False), key=lambda t: -len(t[0])):
        with contextlib.suppress(OSError):
            os.rmdir(top)  # only an empty folder: never anything someone else put there
    return kept + others


# --------------------------------------------------------------------------- may OUT be written?
def _export_refusal(out: Path, run_dir: Path) -> str | None:
    """Why ``--export`` may not write to ``out`` (it would replace what it did not write), or None."""
    if out.name in ("", ".", ".."):
        return "it is '.', '..' or '/'"
    if len(os.fsencode(out.name)) > _NAME_MAX - _SIBLING_EXTRA:
        return f"its name is longer than {_NAME_MAX - _SIBLING_EXTRA} bytes (the temporary beside it adds {_SIBLING_EXTRA})"
    if out.is_symlink():
        return "it is a symbolic link"
    path, run = out.resolve(), run_dir.resolve()
    if path == run or path in run.parents:
        return "it is the run directory (log.run_dir) or holds it"
    if run in path.parents:
        return "it lies inside the run directory (log.run_dir), whose entries the run itself replaces"
    why = protected(path)
    if why is not None:
        return why
    parent = next(p for p in (out.parent.absolute(), *out.parent.absolute().parents) if p.exists())
    if not parent.is_dir():
        return f"it lies under {parent}, which is a file"
    if not out.exists() and not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    if not out.exists():
        return None
    if not out.is_dir():
        return "it is a file, not a directory"
    if not any(out.iterdir()):
        return None
    files = listing(out)
    if files is None:
        return (
            f"it is not empty and not an earlier export (no {EXPORT_MARKER} marker recording each file's size "
            "and hash)"
        )
    return unverified(out, files, hashes=False)


def check_export_target(out: str | Path, run_dir: str | Path) -> None:
    """``ConfigError`` (one line naming ``out`` and why) unless ``--export`` may write ``out`` (module
    docstring)."""
    out = export_path(out)
    why = _export_refusal(out, Path(run_dir))
    if why:
        raise ConfigError(
            f"--export refuses OUT={out}: {why}; choose an OUT that is absent, empty or an earlier export"
        )


# --------------------------------------------------------------------------- the swap
def _holder() -> dict:
    return {"pid": os.getpid(), "start": process_start(os.getpid()), "host": socket.gethostname()}


def export_tmp(out: str | Path) -> Path:
    """A new temporary directory beside ``out`` (mode 0700) for an export to be written into, holding who
    writes it (``TMP_HOLDER``); what a killed export left beside ``out`` is removed first."""
    out = export_path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=_TMP, dir=out.parent))
    _write_new(tmp / TMP_HOLDER, json.dumps(_holder()) + "\n")
    return tmp


def _write_new(path: Path, text: str) -> None:
    """Create ``path`` and write ``text``; never through a symbolic link, never over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def clean_leftovers(out: Path) -> list[Path]:
    """Remove what killed exports to ``out`` left beside it: aside folders by ``remove_verified`` (what is not
    exactly the recorded export stays), temporary folders whose writer (``TMP_HOLDER``) is no longer alive
    on this host. Returns what was removed."""
    removed = []
    for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.*")):
        if path.is_symlink() or not path.is_dir():
            continue
        if path.name.endswith(_OLD):
            files = listing(path)
            if files is not None and not remove_verified(path, files) and not path.exists():
                removed.append(path)
        elif path.name.endswith(_TMP):
            try:
                holder = json.loads((path / TMP_HOLDER).read_text())
            except (OSError, ValueError):
                continue
            if (
                isinstance(holder, dict)
                and holder.get("host") == socket.gethostname()
                and not holder_alive(holder)
            ):
                shutil.rmtree(path)
                removed.append(path)
    for path in removed:
        log.info(f"removed {path}, left by an interrupted export to {out}")
    return removed


def _mark(tmp: Path) -> None:
    (tmp / TMP_HOLDER).unlink()
    files = {name: file_record(tmp / name) for name in _regular_files(tmp)}
    marker = {"written_by": "python -m jagg.train --export", "checksum": "sha256", "files": files}
    _write_new(tmp / EXPORT_MARKER, json.dumps(marker, indent=1) + "\n")


def place_export(tmp: Path, out: str | Path, run_dir: str | Path) -> Path:
    """Mark the finished export in ``tmp`` and rename it to ``out`` (module docstring: one rename onto an
    absent or empty ``out``; an earlier export is moved aside, checked byte for byte, then deleted or put
    back). ``ConfigError`` (``tmp`` removed, ``out`` as it was) when ``out`` may not be replaced."""
    out = export_path(out)
    try:
        check_export_target(out, run_dir)
        _mark(tmp)
        try:
            os.rename(tmp, out)  # absent or empty: one step; the kernel refuses a non-empty directory
            return out
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        aside = out.with_name(tmp.name.removesuffix(_TMP) + _OLD)
        os.rename(out, aside)
        files = listing(aside)
        if files is None:  # it was empty at the check: whatever it holds now is someone else's
            why = f"it holds {sorted(os.listdir(aside))[0]!r}, written there meanwhile, and no {EXPORT_MARKER} marker"
        else:
            why = unverified(aside, files, hashes=True)
        if why is not None:
            _put_back(aside, out)
            raise ConfigError(f"--export refuses OUT={out}: {why}; left as it was")
        try:
            os.rename(tmp, out)
        except OSError:
            _put_back(aside, out)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kept = remove_verified(aside, files)
    if kept:
        log.warning(
            f"the earlier export in {out} was replaced; {aside} keeps {kept[0]!r}, written there meanwhile"
        )
    return out


def _put_back(aside: Path, out: Path) -> None:
    try:
        os.rename(aside, out)
    except OSError as err:
        raise ConfigError(
            f"--export: {out} changed while the earlier export was checked; the earlier export is in {aside} "
            f"({err.strerror})"
        ) from None
