"""The Makefile's float kernels (``KERNELS``): every target runs torch on AVX2 kernels on every x86-64 CPU, so that
the world's build, its runs and the tests' golden runs are the same bit for bit on AVX2 and AVX-512 machines.
Each check runs ``make`` itself, with this interpreter as its Python."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def clean_env() -> dict[str, str]:
    """This process's environment without the kernel variables, and without the make variables of a ``make test``
    that runs this file (its ``MAKEFLAGS`` would pass its own ``KERNELS`` on)."""
    drop = {*KERNEL_VARIABLES, "KERNELS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def make(*args: str, py: str = sys.executable) -> subprocess.CompletedProcess:
    # STAMP= : no .venv needed; PY= : by default this interpreter, which has torch.
    return subprocess.run(
        ["make", "-s", "--no-print-directory", *args, "STAMP=", f"PY={py}"],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def native_capability() -> str:
    """The kernels torch picks here by itself: this process's where none of the variables is set, else a fresh
    interpreter's without them."""
    if not any(name in os.environ for name in KERNEL_VARIABLES):
        return torch.backends.cpu.get_cpu_capability()
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_targets_run_on_avx2_kernels_by_default():
    if platform.machine() not in ("x86_64", "AMD64") or native_capability() not in ("AVX2", "AVX512"):
        pytest.skip("AVX2 kernels exist on x86-64 CPUs with AVX2 only")
    done = make("kernels")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "AVX2"


def test_kernels_native_leaves_the_cpu_its_own():
    done = make("kernels", "KERNELS=native")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == native_capability()


def test_an_unknown_kernel_level_names_the_key_and_its_values_and_exits_2():
    done = make("kernels", "KERNELS=avx3")
    assert done.returncode == 2
    assert "KERNELS must be avx2" in done.stderr and "native" in done.stderr and "'avx3'" in done.stderr
    assert done.stdout == ""  # refused before any recipe ran


def test_the_tests_run_on_the_pinned_kernels():
    """``make test`` keeps the pin: the golden runs (tests/test_golden_runs.py) are bitwise only on the kernels
    that recorded them."""
    # a PY that prints the test recipe's kernel variables instead of running pytest ($$: make's escape)
    done = make(
        "test", py="sh -c 'echo $$ATEN_CPU_CAPABILITY $$MKL_ENABLE_INSTRUCTIONS $$ONEDNN_MAX_CPU_ISA' --"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["avx2", "AVX2", "AVX2"]
    golden = json.loads((ROOT / "tests/golden/trainer_runs.json").read_text())
    assert golden["cpu"].endswith("/ AVX2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU run names its device instead")
def test_hardware_names_the_kernels_torch_runs():
    from jagg.common import hardware

    assert hardware().endswith(f", {torch.backends.cpu.get_cpu_capability()} kernels")
