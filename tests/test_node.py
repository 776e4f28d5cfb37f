"""The node preflight (``jagg.ops.node``): the report of torch's CUDA build, the driver, NCCL and the GPUs, the
driver / build mismatch (mocked: this machine has no driver), the CUDA run's environment defaults, and
rank-tagged log lines."""

from __future__ import annotations

import logging
import os

import pytest

from jagg.config import TINY_RUN, load_config
from jagg.errors import ConfigError
from jagg.ops import node
from jagg.ops.node import NodeFacts, check_node, cuda_run_env, install_hint, node_report, parse_driver_file
from jagg.train import configure_logging, main

PAPER = "configs/paper/flux_dancegrpo.yaml"
WORLD = "configs/world/flux_dancegrpo.yaml"
PROC_TEXT = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Tue Mar  5 22:15:33 UTC 2024\nGCC version:  gcc version 12.3.0\n"
)
OLD = NodeFacts(
    torch_version="2.14.1+cu130",
    cuda_build="13.0",
    driver="550.54.15",
    nccl="2.30.7",
    gpus=("NVIDIA H100 80GB HBM3 (79.2 GiB)",) * 8,
    cuda_available=False,
)
GOOD = NodeFacts(**{**OLD.__dict__, "driver": "580.65.06", "cuda_available": True})
# an NGC container on a 550 datacenter driver: its cuda-compat libcuda (CUDA 13.0) runs the CUDA 13 build
FORWARD = NodeFacts(**{**OLD.__dict__, "cuda_available": True, "driver_cuda": "13.0"})
NONE = NodeFacts(**{**OLD.__dict__, "driver": None, "gpus": ()})
CUDA_ENV = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
)


@pytest.fixture
def clean_env(monkeypatch):
    for key in CUDA_ENV:  # set, then deleted: whatever the test sets is removed again afterwards
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    return monkeypatch


def _mock(monkeypatch, facts: NodeFacts) -> None:
    monkeypatch.setattr(node, "node_facts", lambda gpus=True: facts)
    monkeypatch.setattr(node, "driver_version", lambda: facts.driver)


def test_driver_version_parsed_from_proc():
    assert parse_driver_file(PROC_TEXT) == "550.54.15"
    assert (
        parse_driver_file("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul") == "580.65.06"
    )
    assert parse_driver_file("no driver here") is None


def test_mismatch_rules():
    assert OLD.required_driver == 580 and OLD.driver_too_old
    assert not GOOD.driver_too_old and not NONE.driver_too_old  # no driver: nothing to compare
    cu12 = NodeFacts(**{**OLD.__dict__, "cuda_build": "12.6"})
    assert cu12.required_driver == 525 and not cu12.driver_too_old
    cpu_build = NodeFacts(**{**OLD.__dict__, "cuda_build": None})
    assert cpu_build.required_driver is None and not cpu_build.driver_too_old
    hint = install_hint(OLD)
    assert "driver >= 580" in hint and "550.54.15" in hint and "whl/cu126" in hint
    with pytest.raises(Exception, match="install NVIDIA driver >= 580"):
        check_node(OLD, "cuda")
    with pytest.raises(Exception, match="install NVIDIA driver >= 580"):
        check_node(OLD, "auto")  # auto would quietly train on the CPU
    check_node(OLD, "cpu")  # a CPU run does not care
    check_node(GOOD, "cuda")


def test_forward_compatibility_is_accepted_and_reported():
    """The kernel driver (550) is older than the CUDA 13 build needs, but CUDA initialises: accepted, and the
    report says why; the same driver where CUDA does not initialise is refused."""
    assert FORWARD.driver_too_old and FORWARD.forward_compatible and not FORWARD.unusable
    assert OLD.unusable and not OLD.forward_compatible
    for device in ("cuda", "auto"):
        check_node(FORWARD, device)
    text = "\n".join(node_report(FORWARD))
    assert "550.54.15 (older than the build's >= 580, but CUDA initialises: forward compatibility" in text
    assert "(CUDA 13.0)" in text and "TOO OLD" not in text


def test_libcuda_version(monkeypatch):
    """``cuDriverGetVersion``'s integer (1000 * major + 10 * minor) read through a stand-in libcuda."""
    import ctypes

    class LibCuda:
        def __init__(self, value: int, status: int = 0):
            self.value, self.status = value, status

        def cuDriverGetVersion(self, ref):
            ref._obj.value = self.value
            return self.status

    for value, text in ((13000, "13.0"), (12080, "12.8")):
        monkeypatch.setattr(ctypes, "CDLL", lambda name, v=value: LibCuda(v))
        assert node.libcuda_version() == text
    monkeypatch.setattr(ctypes, "CDLL", lambda name: LibCuda(13000, status=100))  # CUDA_ERROR_NO_DEVICE
    assert node.libcuda_version() is None

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert node.libcuda_version() is None


def test_report_names_build_driver_nccl_gpus():
    text = "\n".join(node_report(OLD))
    for part in ("2.14.1+cu130", "CUDA 13.0 build", "550.54.15 (TOO OLD", "NCCL 2.30.7", "8 x NVIDIA H100"):
        assert part in text, part
    assert "none found" in "\n".join(node_report(NONE))
    assert "(ok" in "\n".join(node_report(GOOD))


def _fails(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_dry_run_reports_node_and_exits_2_on_a_mismatch(tmp_path, capsys, clean_env):
    _mock(clean_env, GOOD)
    assert main(["--config", PAPER, "--dry-run", "--world-size", "8", f"log.run_dir={tmp_path}/r"]) == 0
    out = capsys.readouterr().out
    assert "node: NVIDIA driver 580.65.06 (ok" in out and "node: NCCL 2.30.7" in out
    assert "memory per rank" in out
    _mock(clean_env, OLD)
    err = _fails(capsys, ["--config", PAPER, "--dry-run", "--world-size", "8"])
    assert (
        err.startswith("error: train.device=cuda: torch 2.14.1+cu130")
        and "install NVIDIA driver >= 580" in err
    )
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # a dry run sets nothing


def test_forward_compatible_node_runs(tmp_path, capsys, clean_env):
    """The dry run on a forward-compatible node plans (exit 0) and reports it; a CUDA run passes the node check
    and gets its environment (the fused-optimizer probe on the GPU this machine lacks is stubbed)."""
    _mock(clean_env, FORWARD)
    assert main(["--config", PAPER, "--dry-run", "--world-size", "8", f"log.run_dir={tmp_path}/r"]) == 0
    out = capsys.readouterr().out
    assert "but CUDA initialises: forward compatibility" in out and "memory per rank" in out
    cfg = load_config(WORLD, [*TINY_RUN, f"log.run_dir={tmp_path}/run", "train.device=cuda"])
    clean_env.setattr(node, "check_fused", lambda cfg, device: None)
    assert node.prepare_node(cfg, dry_run=False) == FORWARD
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_dry_run_without_driver_still_plans(capsys, clean_env):
    _mock(clean_env, NONE)
    assert main(["--config", PAPER, "--dry-run", "--world-size", "8"]) == 0
    assert "node: NVIDIA driver none found" in capsys.readouterr().out


def test_cuda_run_with_old_driver_exits_2_before_writing(tmp_path, capsys, clean_env):
    _mock(clean_env, OLD)
    run_dir = tmp_path / "run"
    for device in ("cuda", "auto"):
        err = _fails(
            capsys, ["--config", WORLD, *TINY_RUN, f"log.run_dir={run_dir}", f"train.device={device}"]
        )
        assert "install NVIDIA driver >= 580" in err
    assert not run_dir.exists()
    # set before CUDA starts, for the run that was refused here: the allocator and the flight recorder
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(run_dir.resolve() / "nccl_trace_rank_")


def test_cpu_run_looks_at_nothing(tmp_path, clean_env):
    _mock(clean_env, OLD)
    cfg = load_config(WORLD, [*TINY_RUN, f"log.run_dir={tmp_path}"])
    assert node.prepare_node(cfg, dry_run=False) is None
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_only_rank_0_asks_for_the_gpus(clean_env, monkeypatch):
    """Under torchrun the other ranks touch no GPU before the process group sets their device."""
    asked: list[bool] = []
    monkeypatch.setattr(node, "node_facts", lambda gpus=True: asked.append(gpus) or GOOD)
    monkeypatch.setattr(node, "driver_version", lambda: GOOD.driver)
    cfg = load_config(PAPER)
    for rank in ("0", "3"):
        monkeypatch.setenv("RANK", rank)
        node.prepare_node(cfg, dry_run=True)
    assert asked == [True, False]


def test_cuda_env_keeps_what_the_user_set(tmp_path):
    env = {"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    done = cuda_run_env(tmp_path, env)
    assert set(done) == {"TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"}
    assert env["PYTORCH_ALLOC_CONF"] == "backend:cudaMallocAsync" and "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0" and "TORCH_FR_BUFFER_SIZE" not in env
    fresh: dict[str, str] = {}
    assert cuda_run_env(tmp_path, fresh)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert (
        fresh["TORCH_FR_BUFFER_SIZE"] == node.FLIGHT_RECORDER_ENTRIES
        and fresh["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    )


def test_log_lines_are_rank_tagged_under_torchrun(monkeypatch, capsys):
    root = logging.getLogger("jagg")
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "3")
    configure_logging()
    logging.getLogger("jagg.test").info("hello")
    logging.getLogger("jagg.test").warning("slow")
    out, err = capsys.readouterr()
    assert out == "[rank 3/8] hello\n" and err == "warning: [rank 3/8] slow\n"


def test_sdpa_kernels_are_applied_on_a_cuda_run_and_reported(tmp_path, capsys, clean_env):
    """train.sdpa_kernels: a CUDA run enables exactly those attention kernels; the report names them (a dry run
    only reports, a CPU run touches nothing). The paper configs leave cuDNN out (results/gpu/README.md)."""
    flags = node.sdpa_kernel_flags()
    try:
        _mock(clean_env, FORWARD)
        assert main(["--config", PAPER, "--dry-run", "--world-size", "8", f"log.run_dir={tmp_path}/r"]) == 0
        assert "node: attention kernels: flash, mem_efficient, math only" in capsys.readouterr().out
        assert node.sdpa_kernel_flags() == flags
        over = [*TINY_RUN, f"log.run_dir={tmp_path}/run", "train.sdpa_kernels=[math, flash]"]
        cfg = load_config(WORLD, [*over, "train.device=cuda"])
        clean_env.setattr(node, "check_fused", lambda cfg, device: None)
        node.prepare_node(cfg, dry_run=False)
        assert node.sdpa_kernel_flags() == {
            "flash": True,
            "mem_efficient": False,
            "cudnn": False,
            "math": True,
        }
        node.apply_sdpa_kernels(["mem_efficient"])
        node.prepare_node(load_config(WORLD, over), dry_run=False)  # a CPU run: the flags stay as they were
        assert [k for k, on in node.sdpa_kernel_flags().items() if on] == ["mem_efficient"]
    finally:
        node.apply_sdpa_kernels([k for k, on in flags.items() if on])
    assert load_config(WORLD).train.sdpa_kernels is None  # torch's own choice unless a config says otherwise
    for bad in ("[flash, cudnn2]", "[]"):
        with pytest.raises(ConfigError, match=r"train\.sdpa_kernels must be null or a non-empty list from"):
            load_config(WORLD, [f"train.sdpa_kernels={bad}"])
