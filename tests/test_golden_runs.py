"""Behaviour unchanged: every world config's 3-iteration tiny run against what the trainer wrote before the
plug-in refactor (``tests/golden/trainer_runs.py`` recorded it; that module says how and why).

Each case's metrics rows (timings left out) and its checkpoint tensors (one sha256 over every tensor's name,
dtype, shape and bytes) must be bitwise equal to the recording. On a CPU other than the recording's (another
model, or torch's kernels on another instruction set) float kernels round differently, so there the rows'
numbers and the per-part tensor sums are compared to 1e-6 instead; the recording names its CPU.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import trainer_runs  # noqa: E402

GOLDEN = json.loads(trainer_runs.OUT.read_text())
SAME_MACHINE = GOLDEN["cpu"] == trainer_runs.machine()


def _close(a, b, path: str = "") -> list[str]:
    """Where two JSON values differ beyond 1e-6 (relative), with their paths."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in _close(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _close(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        same = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
        return [] if same else [f"{path}: {a!r} != {b!r}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.mark.parametrize("case", sorted(GOLDEN["cases"]))
def test_a_three_iteration_run_is_what_the_trainer_wrote_before(case, tmp_path):
    want = GOLDEN["cases"][case]
    got = json.loads(json.dumps(trainer_runs.run_case(want["config"], want["overrides"], tmp_path)))
    if SAME_MACHINE:
        assert not _close(got["rows"], want["rows"]), _close(got["rows"], want["rows"])  # says where
        assert json.dumps(got["rows"], sort_keys=True) == json.dumps(want["rows"], sort_keys=True)
        assert got["tensors"]["sha256"] == want["tensors"]["sha256"]
    else:
        assert not _close(got["rows"], want["rows"])
        assert not _close(got["tensors"]["parts"], want["tensors"]["parts"])


def test_the_comparison_detects_a_changed_number():
    """The control: a row with one number moved by 1e-5 (relative) is told apart, and so is a missing key."""
    rows = GOLDEN["cases"]["flux_dancegrpo"]["rows"]
    moved = json.loads(json.dumps(rows))
    moved[1]["loss"] *= 1 + 1e-5
    assert _close(moved, rows) and json.dumps(moved, sort_keys=True) != json.dumps(rows, sort_keys=True)
    del moved[1]["loss"]
    assert _close(moved, rows)
