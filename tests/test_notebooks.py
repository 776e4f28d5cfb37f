"""Execute both notebooks (on small inputs) so they never rot."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["explore_results.ipynb", "jagg_group_walkthrough.ipynb"])
def test_notebook_executes(name, monkeypatch):
    monkeypatch.setenv("JAGG_ROOT", str(ROOT))
    monkeypatch.setenv("JAGG_SOURCE", "tiny")  # random-init world backbone: no `make pretrain` needed
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    ).execute()
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    if name.startswith("jagg"):
        assert "manual == library JAGG: True" in text
        assert "backward passes: exact 3, JAGG 2" in text
