"""Plumbing shared by the drivers: threads, named seed streams, run metadata (git SHA, versions, hardware),
atomic writes, a progress line with an ETA for long drivers, and the old names of renamed keywords."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
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
    CONTROL = 60_000  # the positive control's fixed gradient direction (plugins.control.cosine): index 0 only
    KNOTS = 70_000  # the measurement rollouts of experiments/knots.py
    CALIBRATION = 80_000  # index = iteration: the SDE noise of the windows a MixGRPO calibration rebuilds


def generator(seed: int, stream: SeedStream, index: int = 0) -> torch.Generator:
    """A fresh CPU generator for draw ``index`` of ``stream`` in a run seeded ``seed`` (same on every rank)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + (int(stream) + index) * 7919)


# Folders of generated artefacts (what drivers write, never code). Their uncommitted files are named in a record
# by content (git blob id), never diffed into it: a record whose diff held another run's uncommitted record,
# which held this run's earlier one, doubled in size per run (two protocols writing at once, issue 56).
GENERATED = ("results/**", "paper_figures/**")


def tree_state(
    ignore: Iterable[str] = (), short: bool = False, root: Path | None = None
) -> tuple[str, str | None]:
    """``(sha, diff)``: the current commit, suffixed "-dirty" when tracked files have uncommitted changes, and
    then their diff (``git diff HEAD``); ``("unknown", None)`` outside a git checkout. ``ignore``: git pathspec
    globs relative to the repository root (``results/table1*``) left out of both: a driver's own outputs, which
    the run rewrites, do not make its record dirty (``experiments/curves.py`` leaves its results folder out
    the same way); a pattern outside the checkout is refused by git, and then the state is "unknown", never
    clean. Uncommitted files under ``GENERATED`` make the tree dirty too, but the diff names them by blob id
    in ``#`` lines before the code's diff (which ``git apply`` skips), so a record's size does not grow with
    the results beside it. ``root``: the checkout (default: this package's)."""
    root = root or Path(__file__).resolve().parents[2]
    mine = [f":(exclude,glob){p}" for p in ignore]
    spec = ["--", ".", *mine]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout

    try:
        sha = git("rev-parse", "--short" if short else "HEAD").strip()
        # a failed check (a pattern git refuses) is not a clean tree
        if not git("status", "--porcelain", "--untracked-files=no", *spec).strip():
            return sha, None
        generated = [f":(glob){p}" for p in GENERATED]
        data = git("diff", "HEAD", "--name-only", "--", *generated, *mine).splitlines()
        present = [p for p in data if (root / p).is_file()]
        ids = git("hash-object", "--", *present).splitlines() if present else []
        blobs = dict(zip(present, ids, strict=True))
        named = "".join(f"# uncommitted, not stored: {p} {blobs.get(p, 'deleted')}\n" for p in data)
        code = git("diff", "HEAD", *spec, *(f":(exclude,glob){p}" for p in GENERATED))
        return sha + "-dirty", named + code
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None


def git_sha(short: bool = False, ignore: Iterable[str] = ()) -> str:
    """Current commit (suffixed "-dirty" if the tree has uncommitted changes outside ``ignore``), or "unknown"."""
    return tree_state(ignore, short)[0]


def hardware() -> str:
    """Human-readable hardware string, e.g. "CPU (AMD EPYC), 2 cores (x86_64), 1 torch thread, AVX2 kernels".
    The kernels are the ones torch dispatches to (``ATEN_CPU_CAPABILITY``, which ``make`` pins to AVX2): two
    machines with the same model name can run different ones, and then their floats differ."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch.get_num_threads()
    model = cpu_model()
    return (
        f"CPU{f' ({model})' if model else ''}, {cores} cores ({platform.machine()}), "
        f"{threads} torch thread{'s' * (threads != 1)}, {torch.backends.cpu.get_cpu_capability()} kernels"
    )


def cpu_model() -> str | None:
    """The CPU's model name (Linux), or None: float kernels, hence some results, differ between CPUs."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


# The libraries whose versions can change a number: the numerics, the model code, the reward models, the data.
VERSIONED = (
    "torch",
    "diffusers",
    "transformers",
    "peft",
    "open-clip-torch",
    "datasets",
    "numpy",
    "safetensors",
)


def versions() -> dict[str, str]:
    """Versions of the libraries that determine the numbers (``VERSIONED``) and, for a torch built with CUDA, the
    CUDA / cuDNN / NCCL versions compiled into it (present on a CUDA build even on a machine without a GPU;
    ``hardware()`` says whether one was used)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in VERSIONED:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "missing"
    if torch.version.cuda:
        out["cuda_build"] = torch.version.cuda
        if torch.backends.cudnn.is_available():
            out["cudnn"] = str(torch.backends.cudnn.version())
        nccl = getattr(torch.cuda, "nccl", None)
        if nccl is not None and torch.distributed.is_nccl_available():
            out["nccl"] = ".".join(map(str, nccl.version()))
    return out


def command_line(script: str, argv: list[str] | None = None) -> str:
    """How a driver was invoked, ``python <script> <args>``; ``argv`` None means this process's arguments."""
    return " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)])


def run_metadata(*, outputs: Iterable[str] = (), **extra) -> dict:
    """What every result records: git SHA, versions, hardware (the CPU kernels included), plus caller fields
    (config, seed, ...). ``outputs``: the driver's own results (pathspec globs, ``tree_state``), left out of
    the dirty check; anything else uncommitted is recorded as ``git_diff``, so the code can be rebuilt."""
    sha, diff = tree_state(outputs)
    meta = {"git_sha": sha, "hardware": hardware(), "versions": versions(), **extra}
    if diff is not None:
        meta["git_diff"] = diff
    return meta


def _umask() -> int:
    """The process umask (read by setting it and restoring it at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def open_for_writing(path: str | Path, *, append: bool = False):
    """``open(path, "a" / "w")`` that never writes through a symbolic link planted at ``path`` (``O_NOFOLLOW``):
    ``OSError`` (``ELOOP``) naming it instead, which the CLI prints as one line."""
    import errno

    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link, never written through", str(path)) from None
        raise
    return os.fdopen(fd, "a" if append else "w")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write via a temporary file + rename, so an interrupted run never leaves a half-written file.

    A symbolic link at ``path`` is refused (``OSError``, ``ELOOP``), as ``open_for_writing`` refuses one. The file
    gets the permissions an ordinary ``open(path, "w")`` would (0666 minus the umask; ``mkstemp``
    alone gives 0600), and is fsynced before the rename and its directory after it, so the new content
    survives a crash of the machine, not only of the process.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():  # the rename would replace the link; refused like every write through one
        import errno

        raise OSError(errno.ELOOP, "a symbolic link, never written through", str(path))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: str | Path) -> None:
    """fsync a directory, so that a rename inside it is durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def format_seconds(seconds: float) -> str:
    """``42s``, ``7m05s``, ``1h02m``: a duration for a progress line."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressETA:
    """Progress of a long driver: one line per finished unit, ``[ 3/24  12%] flux dancegrpo it 2 | elapsed
    1m05s | ETA 7m40s``, on ``stream`` (stderr, looked up per line, when None).

    The ETA is elapsed / done x remaining, i.e. it assumes the units cost alike; give units of similar size
    (an iteration, a run). Used by make table1 / cosine / routing and the CLI's per-iteration line.
    """

    def __init__(self, total: int, label: str = "", stream=None, clock=time.perf_counter) -> None:
        self.total, self.label, self.stream, self.clock = max(int(total), 1), label, stream, clock
        self.done, self.start = 0, clock()

    def eta_seconds(self, elapsed: float | None = None) -> float:
        """Seconds left at the mean pace so far (0 when done; inf before the first unit)."""
        if self.done == 0:
            return math.inf
        elapsed = self.clock() - self.start if elapsed is None else elapsed
        return elapsed / self.done * max(self.total - self.done, 0)

    def line(self, what: str = "") -> str:
        """The progress line after ``self.done`` units (without writing it)."""
        width = len(str(self.total))
        pct = 100 * self.done / self.total
        head = " ".join(x for x in (self.label, what) if x)
        elapsed = self.clock() - self.start
        eta = self.eta_seconds(elapsed)
        eta_text = format_seconds(eta) if math.isfinite(eta) else "?"
        return f"[{self.done:>{width}}/{self.total} {pct:3.0f}%] {head} | elapsed {format_seconds(elapsed)} | ETA {eta_text}"

    def step(self, what: str = "", n: int = 1) -> str:
        """Count ``n`` finished units, write the line and return it."""
        self.done += n
        text = self.line(what)
        stream = self.stream or sys.stderr
        stream.write(text + "\n")
        stream.flush()
        return text


# What a rerun changes in a result's record without changing the result: the commit that ran it and its diff.
PROVENANCE_KEYS = ("git_sha", "git_diff")


def write_table(rows: list[dict], path: str | Path, meta: dict) -> dict:
    """Write rows as CSV plus ``<stem>.meta.json`` (config, SHA, versions, hardware), both atomically. A table
    whose CSV and record are already on disk, equal but for ``PROVENANCE_KEYS``, is left as it is: a rerun
    that reproduces a committed result (``make figures``' computed memory plan) does not leave the tree dirty
    for the next driver's SHA; the record keeps the commit that first wrote it. Returns the record on disk
    (what a figure drawn from the table names)."""
    import pandas as pd

    path, record = Path(path), Path(path).with_suffix(".meta.json")
    csv, text = pd.DataFrame(rows).to_csv(index=False), json.dumps(meta, indent=2, default=str) + "\n"
    if _unchanged(path, csv, record, json.loads(text)):
        return json.loads(record.read_text())
    atomic_write_text(path, csv)
    atomic_write_text(record, text)
    return json.loads(text)


def _unchanged(path: Path, csv: str, record: Path, meta: dict) -> bool:
    """Whether ``path`` holds ``csv`` and ``record`` holds ``meta`` up to ``PROVENANCE_KEYS``."""
    try:
        if path.is_symlink() or record.is_symlink() or path.read_text() != csv:
            return False
        old = json.loads(record.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False

    def strip(m):
        return {k: v for k, v in m.items() if k not in PROVENANCE_KEYS} if isinstance(m, dict) else m

    return strip(old) == strip(meta)


def markdown_table(df, floatfmt: str = "{:.4f}") -> str:
    """A pandas DataFrame as a GitHub Markdown table (no extra dependency)."""

    def fmt(v) -> str:
        return floatfmt.format(v) if isinstance(v, float) else str(v)

    head = "| " + " | ".join(map(str, df.columns)) + " |"
    rows = ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, "|" + "---|" * len(df.columns), *rows])


def peak_memory_mb(device: torch.device) -> float:
    """The process's peak memory on ``device``: CUDA's allocated peak, else the host's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# --------------------------------------------------------------------------- the expert switch
NUM_TRAIN_TIMESTEPS = 1000  # FlowMatchEulerDiscreteScheduler's, which WanPipeline scales the boundary by


def expert_side(sigma: torch.Tensor | float, boundaries: tuple[float, ...] | list[float]) -> torch.Tensor:
    """How many expert boundaries lie at or below each step's time: 0 for the low-noise side of every switch.
    The one rule the model (``jagg.models.wan.WanBackbone``, which network runs a step) and the knots planner
    (``jagg.engine.knots.expert_segments``, where knots may not straddle a switch) share.

    As diffusers' ``WanPipeline`` decides it (pipeline_wan.py, ``__call__``: ``boundary_timestep =
    boundary_ratio * num_train_timesteps``; ``if t >= boundary_timestep`` runs ``transformer``): on the float32
    timestep ``1000 * float32(sigma)``, not on sigma in float64. On Wan2.2-A14B's 10-step shift-3 schedule
    sigma_3 is 0.8749999999999999 in float64, 0.875 in float32: timestep 875 >= 875, the high-noise expert."""
    t = torch.as_tensor(sigma).to(torch.float32) * NUM_TRAIN_TIMESTEPS
    side = torch.zeros(t.shape, dtype=torch.long, device=t.device)
    for b in boundaries:
        side += (t >= b * NUM_TRAIN_TIMESTEPS).long()
    return side


def auto_field(default, allowed: str):
    """A config field whose YAML value may be ``auto``: None in the dataclass (decided at run time), ``default``
    otherwise; the metadata says what else the key allows (``jagg.config`` reads it and names it in errors)."""
    return dataclasses.field(default=default, metadata={"auto": allowed})
