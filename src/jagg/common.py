"""Plumbing shared by the drivers: threads, named seed streams, run metadata (git SHA, versions, hardware),
atomic writes."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from enum import IntEnum
from pathlib import Path

import torch


def set_threads(n: int = 1) -> None:
    """One torch thread per process by default (2-core machines: OpenMP spin-wait, docs/decisions.md)."""
    torch.set_num_threads(n)


class SeedStream(IntEnum):
    """The named streams of random draws of a run; ``generator(seed, stream, index)`` gives index ``index``.

    A stream is a block of indices starting at its value (``generator`` seeds with
    ``seed * 1_000_003 + (stream + index) * 7919``), so two streams never share a generator while indices stay
    below the gap to the next stream (10_000). The values are the offsets the drivers used before the streams
    were named, so every committed result keeps its seeds.
    """

    EVAL = -1  # held-out evaluation noise: index 0 only, the same draws at every evaluation
    ROLLOUT = 0  # training rollouts, index = iteration: prompts, initial noise, SDE seeds, trained steps
    WARMUP = 10_000  # a rollout whose update warms up the allocator and kernels before timing (table1)
    MEMORY = 20_000  # the rollout whose update is measured for saved activations (table1)
    FINETUNE = 50_000  # the short RL fine-tune that moves the policy before a measurement (cosine, after_rl)
    CONTROL = 60_000  # the positive control's fixed gradient direction (train.control_cosine): index 0 only


def generator(seed: int, stream: SeedStream, index: int = 0) -> torch.Generator:
    """A fresh CPU generator for draw ``index`` of ``stream`` in a run seeded ``seed`` (same on every rank)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + (int(stream) + index) * 7919)


def git_sha(short: bool = False) -> str:
    """Current commit (suffixed "-dirty" if the tree has uncommitted changes), or "unknown"."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short" if short else "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware() -> str:
    """Human-readable hardware string, e.g. "CPU, 2 cores (x86_64), 1 torch thread"."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch.get_num_threads()
    return f"CPU, {cores} cores ({platform.machine()}), {threads} torch thread{'s' * (threads != 1)}"


def versions() -> dict[str, str]:
    """Versions of the libraries that determine the numbers."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "diffusers", "transformers", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "missing"
    return out


def command_line(script: str, argv: list[str] | None = None) -> str:
    """How a driver was invoked, ``python <script> <args>``; ``argv`` None means this process's arguments."""
    return " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)])


def run_metadata(**extra) -> dict:
    """What every result records: git SHA, versions, hardware, plus caller fields (config, seed, ...)."""
    return {"git_sha": git_sha(), "hardware": hardware(), "versions": versions(), **extra}


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write via a temporary file + rename, so an interrupted run never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_table(rows: list[dict], path: str | Path, meta: dict) -> None:
    """Write rows as CSV plus ``<stem>.meta.json`` (config, SHA, versions, hardware), both atomically."""
    import pandas as pd

    path = Path(path)
    atomic_write_text(path, pd.DataFrame(rows).to_csv(index=False))
    atomic_write_text(path.with_suffix(".meta.json"), json.dumps(meta, indent=2, default=str) + "\n")


def markdown_table(df, floatfmt: str = "{:.4f}") -> str:
    """A pandas DataFrame as a GitHub Markdown table (no extra dependency)."""

    def fmt(v) -> str:
        return floatfmt.format(v) if isinstance(v, float) else str(v)

    head = "| " + " | ".join(map(str, df.columns)) + " |"
    rows = ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, "|" + "---|" * len(df.columns), *rows])
