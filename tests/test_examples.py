"""examples/own_trainer.py (quoted by the README) runs as a user would run it and prints the right numbers."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

from jagg import group_gradient_cosines

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_trainer.py"


def test_own_trainer_prints_passes_and_the_cosine(capsys):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == [
        "exact: 4 backward passes in 4 backward call(s)",  # W = 4 per-step backwards
        "jagg: 2 backward passes in 1 backward call(s)",  # one joint backward through the two endpoints
    ]
    printed = float(re.fullmatch(r"cosine\(JAGG, exact\) = ([0-9.]+)", lines[2]).group(1))
    # the same cosine from the library's own diagnostic, on the example's model and loss
    ns = runpy.run_path(str(EXAMPLE))
    capsys.readouterr()
    model, loss = ns["model"], ns["loss"]
    (cos,) = group_gradient_cosines(model, loss.x, loss.sigma, loss, list(model.parameters()), group_size=4)
    assert abs(cos.cosine - printed) < 1e-6
    assert 0.5 < printed < 1.0  # an approximation, not the exact gradient, and not an unrelated one


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
