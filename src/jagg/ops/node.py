"""The target node before a CUDA run: what it has (torch's CUDA build, the driver, NCCL, the GPUs), whether they
match, and the environment a CUDA run sets before CUDA initialises.

``prepare_node`` is the CLI's one call (``python -m jagg.train``, after the config loads, before the model code):

    report      one line per fact, on ``--dry-run`` and at the start of every run that may use CUDA
                (``train.device`` cuda or auto): ``node_report(node_facts())``
    check       a kernel driver older than the torch build needs (``MIN_DRIVER``: a CUDA 13 build needs 580 or
                newer) while CUDA does not initialise is a ``ConfigError`` (exit 2, one line saying what to
                install). On such a node ``torch.cuda.is_available()`` is simply False, and ``train.device=auto``
                would quietly train on the CPU. Where CUDA does initialise on the older kernel driver, a newer
                user-mode driver (``libcuda``) runs it: NVIDIA's forward compatibility (the ``cuda-compat``
                package, as in NGC containers on datacenter GPUs). That node is accepted and reported as such.
                No driver at all is fine for a dry run (planning on a laptop) and for ``device=cpu``.
    environment for runs that will use CUDA, defaults the user has not set (``cuda_run_env``):
                ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (read when CUDA initialises, so set first)
                and the NCCL flight recorder (``TORCH_FR_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``,
                ``TORCH_FR_DUMP_TEMP_FILE``: on a collective timeout every rank dumps its last collectives to
                ``log.run_dir/nccl_trace_rank_<r>``), read when the process group starts.
    optimizer   with ``optim.fused``, one fused AdamW step on the run's device (``jagg.scale.optimizer.check_fused``)
    attention   ``train.sdpa_kernels``: on a CUDA run only these SDPA kernels are enabled (``apply_sdpa_kernels``);
                the report names them

The driver version comes from ``/proc/driver/nvidia/version`` (Linux) or ``nvidia-smi``, not from CUDA, so it is
known exactly when CUDA cannot start; the CUDA version the loaded ``libcuda`` supports comes from its
``cuDriverGetVersion`` (it differs from the kernel driver's under forward compatibility). Nothing here downloads or installs anything.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from jagg.config import SDPA_KERNELS, Config
from jagg.errors import ConfigError
from jagg.scale.optimizer import check_fused

log = logging.getLogger("jagg.node")

# CUDA major version of a torch build -> the oldest Linux driver branch that runs it (NVIDIA's CUDA
# compatibility table: 13.x needs 580+, 12.x 525+ with minor-version compatibility, 11.x 450+).
MIN_DRIVER = {13: 580, 12: 525, 11: 450}
# torch wheels per CUDA major version on download.pytorch.org (docs/paper_scale.md, "A torch build for the driver")
WHEEL_INDEX = {13: "cu130", 12: "cu126", 11: "cu118"}
ALLOC_CONF = "expandable_segments:True"
FLIGHT_RECORDER_ENTRIES = "2000"  # collectives each rank keeps for the dump (torch's ring buffer)
DRIVER_FILE = "/proc/driver/nvidia/version"


@dataclass(frozen=True)
class NodeFacts:
    """What this machine offers a CUDA run; ``None`` where there is none (no driver, a CPU-only torch build)."""

    torch_version: str
    cuda_build: str | None  # torch.version.cuda, e.g. "13.0"
    driver: str | None  # e.g. "580.65.06"
    nccl: str | None  # e.g. "2.27.7"
    gpus: tuple[str, ...] = ()  # "NVIDIA H100 80GB HBM3 (79.2 GiB)" per visible GPU
    cuda_available: bool = False
    driver_cuda: str | None = None  # the CUDA version the loaded libcuda supports, e.g. "13.0"

    @property
    def required_driver(self) -> int | None:
        """The oldest driver branch the torch build runs on (None: a CPU build, or a CUDA major not listed)."""
        return None if self.cuda_build is None else MIN_DRIVER.get(_major(self.cuda_build))

    @property
    def driver_too_old(self) -> bool:
        """The kernel driver is older than the build needs (CUDA may still initialise: ``forward_compatible``)."""
        need = self.required_driver
        return self.driver is not None and need is not None and _major(self.driver) < need

    @property
    def forward_compatible(self) -> bool:
        """CUDA initialises although the kernel driver is older than the build needs: a newer user-mode driver
        (NVIDIA's forward compatibility, e.g. an NGC container's ``cuda-compat`` libcuda) runs it."""
        return self.driver_too_old and self.cuda_available

    @property
    def unusable(self) -> bool:
        """The one refused case: the driver is older than the build needs and CUDA does not initialise."""
        return self.driver_too_old and not self.cuda_available


def _major(version: str) -> int:
    return int(version.split(".")[0])


def parse_driver_file(text: str) -> str | None:
    """The version in ``/proc/driver/nvidia/version`` ("NVRM version: NVIDIA UNIX ... Kernel Module  580.65.06 ...")."""
    m = re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version, or None when there is no driver."""
    try:
        found = parse_driver_file(Path(DRIVER_FILE).read_text())
    except OSError:
        found = None
    if found or shutil.which("nvidia-smi") is None:
        return found
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def libcuda_version() -> str | None:
    """The CUDA version the user-mode driver (``libcuda.so.1``) supports, e.g. "13.0" (``cuDriverGetVersion``,
    which needs no context), or None without one. Under forward compatibility it is newer than the kernel
    driver's."""
    import ctypes

    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _nccl_version() -> str | None:
    import torch

    try:
        v = torch.cuda.nccl.version()
    except Exception:  # a build without NCCL
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _gpus(cuda_available: bool) -> tuple[str, ...]:
    """Name and memory of each visible GPU: from torch when CUDA works, else from nvidia-smi."""
    import torch

    if cuda_available:
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        return tuple(f"{p.name} ({p.total_memory / 2**30:.1f} GiB)" for p in props)
    if shutil.which("nvidia-smi") is None:
        return ()
    out = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    rows = [r.rsplit(",", 1) for r in out.splitlines() if "," in r]
    return tuple(f"{name.strip()} ({float(mib) / 1024:.1f} GiB)" for name, mib in rows if _is_number(mib))


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def node_facts(gpus: bool = True) -> NodeFacts:
    """This machine's facts. ``gpus``: also each GPU's name and memory (this initialises CUDA when it is
    available: call after ``cuda_run_env``; under torchrun only each node's LOCAL_RANK 0 asks, the report's
    rank, on its own device 0)."""
    import torch

    available = torch.cuda.is_available()  # a device count, no CUDA context
    return NodeFacts(
        torch_version=torch.__version__,
        cuda_build=torch.version.cuda,
        driver=driver_version(),
        nccl=_nccl_version(),
        gpus=_gpus(available) if gpus else (),
        cuda_available=available,
        driver_cuda=libcuda_version(),
    )


def install_hint(facts: NodeFacts) -> str:
    """What to install on a node whose driver is older than the torch build needs."""
    older = max(
        (m for m, d in MIN_DRIVER.items() if facts.driver and _major(facts.driver) >= d), default=None
    )
    build = f"torch {facts.torch_version} (CUDA {facts.cuda_build} build)"
    fix = f"install NVIDIA driver >= {facts.required_driver}"
    if older is not None:
        fix += (
            f", or a torch build for CUDA {older} with its matching torchvision "
            f"(pip index https://download.pytorch.org/whl/{WHEEL_INDEX[older]}; docs/paper_scale.md)"
        )
    return f"{build} needs NVIDIA driver >= {facts.required_driver}, this node has {facts.driver}: {fix}"


def check_node(facts: NodeFacts, device: str) -> None:
    """``ConfigError`` (one line: what to install) when a driver is present, older than the torch build needs,
    and CUDA does not initialise, unless the run is on the CPU (``train.device=cpu``). A node where CUDA
    initialises on the older driver (forward compatibility) passes."""
    if device != "cpu" and facts.unusable:
        raise ConfigError(f"train.device={device}: {install_hint(facts)}")


def node_report(facts: NodeFacts) -> list[str]:
    """Lines for the log: torch and its CUDA build, the driver against the build's need, NCCL, the GPUs."""
    need = facts.required_driver
    build = f"CUDA {facts.cuda_build} build" if facts.cuda_build else "CPU-only build"
    if facts.driver is None:
        driver = "none found (no NVIDIA kernel module)"
    elif facts.forward_compatible:
        libcuda = f" (CUDA {facts.driver_cuda})" if facts.driver_cuda else ""
        driver = (
            f"{facts.driver} (older than the build's >= {need}, but CUDA initialises: forward compatibility, "
            f"a newer user-mode driver{libcuda} such as an NGC container's cuda-compat)"
        )
    else:
        driver = f"{facts.driver} ({'TOO OLD' if facts.driver_too_old else 'ok'}" + (
            f", the build needs >= {need})" if need else ")"
        )
    gpus = f"{len(facts.gpus)} x {facts.gpus[0]}" if facts.gpus and len(set(facts.gpus)) == 1 else None
    gpus = gpus or (", ".join(facts.gpus) if facts.gpus else "none visible")
    return [
        f"node: torch {facts.torch_version} ({build}" + (f", needs driver >= {need})" if need else ")"),
        f"node: NVIDIA driver {driver}",
        f"node: NCCL {facts.nccl or 'not in this build'}",
        f"node: GPUs {gpus}; torch.cuda.is_available() {facts.cuda_available}",
    ]


def cuda_run_env(run_dir: str | Path, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the CUDA run's defaults in ``environ`` (default ``os.environ``) where the user set nothing; returns
    what was set. The allocator setting is read when CUDA initialises, the flight recorder's when the NCCL
    process group starts, so call this before either."""
    env = os.environ if environ is None else environ
    wanted = {
        "PYTORCH_CUDA_ALLOC_CONF": (ALLOC_CONF, ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")),
        "TORCH_FR_BUFFER_SIZE": (
            FLIGHT_RECORDER_ENTRIES,
            ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
        ),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": ("1", ("TORCH_NCCL_DUMP_ON_TIMEOUT",)),
        "TORCH_FR_DUMP_TEMP_FILE": (
            str(Path(run_dir).resolve() / "nccl_trace_rank_"),
            ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
        ),
    }
    set_now = {}
    for key, (value, names) in wanted.items():
        if not any(n in env for n in names):
            env[key] = set_now[key] = value
    return set_now


def expandable_segments(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether a CUDA run started in ``environ`` allocates with expandable segments: the default
    ``cuda_run_env`` sets, unless the user's own allocator setting says otherwise."""
    env = os.environ if environ is None else environ
    conf = env.get("PYTORCH_ALLOC_CONF", env.get("PYTORCH_CUDA_ALLOC_CONF"))
    return conf is None or "expandable_segments:true" in conf.replace(" ", "").lower()


def uses_cuda(cfg: Config, facts: NodeFacts | None = None) -> bool:
    """Whether the run may use CUDA: ``train.device=cuda``, or ``auto`` on a machine with a driver."""
    device = cfg.train.device
    return device == "cuda" or (
        device == "auto" and (facts.driver if facts else driver_version()) is not None
    )


def apply_sdpa_kernels(kernels: list[str] | None) -> None:
    """Enable exactly ``kernels`` of ``SDPA_KERNELS`` for this process's scaled-dot-product attention
    (``train.sdpa_kernels``); None leaves torch's choice."""
    import torch

    for name in SDPA_KERNELS if kernels is not None else ():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(name in kernels)


def sdpa_kernel_flags() -> dict[str, bool]:
    """Which of ``SDPA_KERNELS`` this process's scaled-dot-product attention may use now."""
    import torch

    return {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in SDPA_KERNELS}


def sdpa_kernels_line(kernels: list[str] | None) -> str:
    """The node report's line for ``train.sdpa_kernels``."""
    if kernels is None:
        return "node: attention kernels: torch's choice (train.sdpa_kernels: null)"
    return f"node: attention kernels: {', '.join(k for k in SDPA_KERNELS if k in kernels)} only (train.sdpa_kernels)"


def prepare_node(cfg: Config, dry_run: bool, facts: NodeFacts | None = None) -> NodeFacts | None:
    """The CLI's node step: on a run that may use CUDA set its environment defaults (before CUDA starts), then
    on such a run or a dry run report the node (each node's LOCAL_RANK 0, its host named when the job spans
    several nodes) and check it (every rank). ``ConfigError`` on a
    driver / build mismatch. Returns the facts, or None for a CPU run (nothing looked at)."""
    import torch

    cuda = uses_cuda(cfg, facts)
    if not cuda and not dry_run:
        check_fused(cfg, torch.device("cpu"))
        return None
    if cuda and not dry_run:
        if torch.cuda.is_initialized():  # pragma: no cover - the CLI calls this before anything touches CUDA
            log.warning("CUDA was initialised before the allocator setting could be applied")
        for key, value in cuda_run_env(cfg.log.run_dir).items():
            log.debug(f"node: set {key}={value}")
        apply_sdpa_kernels(cfg.train.sdpa_kernels)
    # each node's first process (LOCAL_RANK 0) reports its node: on several nodes, global rank 0 would show
    # only its own node's GPUs and driver
    main = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0
    facts = facts or node_facts(gpus=main)
    if main:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        several = 0 < local < int(os.environ.get("WORLD_SIZE", "1"))
        for line in [*node_report(facts), sdpa_kernels_line(cfg.train.sdpa_kernels)]:
            log.info(line.replace("node:", f"node {socket.gethostname()}:", 1) if several else line)
    check_node(facts, cfg.train.device)
    if not dry_run:  # the optimizer on this rank's own GPU (a dry run may plan for another machine)
        on_gpu = facts.cuda_available and cfg.train.device != "cpu"
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        check_fused(cfg, local if on_gpu else torch.device("cpu"))
    return facts
