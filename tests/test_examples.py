"""examples/own_trainer.py (quoted by the README) runs as a user would run it and prints the right numbers."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

from helpers import count_passes

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_trainer.py"
LINE = re.compile(r"(.+): (\d+) backward passes in (\d+) backward calls(?:, (.+))?")


def test_own_trainer_prints_passes_and_the_gradients(capsys):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr  # the example asserts exact == the loop itself
    rows = [LINE.fullmatch(line).groups() for line in out.stdout.splitlines()]
    assert [(name, int(p), int(c)) for name, p, c, _ in rows] == [
        ("per-step loop", 6, 6),  # T = 6 forward + backward pairs
        ("exact", 6, 6),  # the exact plan is the same loop
        ("jagg W=3", 4, 2),  # two groups, each one backward through its two endpoints
        ("knots K=3", 3, 1),  # three shared knots, one backward
    ]
    assert re.fullmatch(r"relative difference to the loop (.+)", rows[1][3])
    for _, _, _, compare in rows[2:]:  # approximations, not the exact gradient, and not unrelated ones
        cosine = float(re.fullmatch(r"cosine to the loop ([0-9.]+)", compare).group(1))
        assert 0.5 < cosine < 1.0
    # the printed counts are what hooks on the transformer count, and what the cost model predicts
    ns = runpy.run_path(str(EXAMPLE))
    capsys.readouterr()
    backbone, velocity, batch = ns["backbone"], ns["velocity"], ns["batch"]
    with count_passes(backbone) as loop:
        ns["per_step_backward"](velocity, batch)
    assert (loop["backward_graphs"], loop["backward_calls"]) == (6, 6)
    for (name, passes, calls, _), setting in zip(rows[1:], ns["settings"].values()):
        with count_passes(backbone) as counted:
            ns["one_plan_backward"](velocity, batch, setting)
        assert counted["backward_calls"] == int(calls), name
        assert setting.cost(ns["T"], batch=1, stored=True).backward_passes == int(passes), name
    backbone.zero_grad(set_to_none=True)


def test_the_readme_snippet_is_taken_from_the_example():
    """Every code line of the README's engine snippet (``...`` marks an omission) is a line of the example file,
    so the README shows code that the test above runs."""
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    section = readme.split("## Use the engine in your own loop", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    example = {line.rstrip() for line in EXAMPLE.read_text().splitlines()}
    code = [line.rstrip() for line in snippet.splitlines() if line.strip() and line.strip() != "..."]
    assert len(code) >= 10
    assert [line for line in code if line not in example] == []
