"""Packaging: every third-party import of the package is a declared dependency, pinned in requirements.txt;
LICENSE and CITATION.cff say what pyproject says; no tracked file is a symbolic link; every driver that records a
commit declares its own outputs."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
# import name -> distribution name, where they differ
DISTRIBUTION = {
    "PIL": "pillow",
    "yaml": "pyyaml",
    "open_clip": "open-clip-torch",
    "huggingface_hub": "huggingface-hub",
}


def _imports(folder: Path) -> set[str]:
    """Top-level names of every absolute import under ``folder`` (inside functions too), stdlib left out."""
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "jagg"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ ;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_every_import_is_declared_and_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    extras = {name: {_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    used = {DISTRIBUTION.get(m, m).lower() for m in _imports(ROOT / "src" / "jagg")}
    # the trackers are imported only when log.report_to names them: an extra, not a core dependency
    # (TensorBoard's own package for the events that purge a resumed run's redone steps); unirl only by
    # jagg.integrations.unirl, installed by the Makefile's own pinned line (its metadata asks for Python >= 3.12)
    assert used - core == {"wandb", "tensorboard", "unirl"} and used - core - {"unirl"} <= extras["trackers"]
    assert "UNIRL := unirl==" in (ROOT / "Makefile").read_text()
    pinned = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            assert "==" in line, f"requirements.txt pins exactly: {line}"
            pinned[_name(line)] = line
    unpinned = (core | extras["trackers"] | extras["experiments"] | extras["dev"]) - set(pinned) - {"wandb"}
    assert not unpinned, f"declared but not pinned in requirements.txt: {sorted(unpinned)}"
    engines = {}
    for line in (ROOT / "requirements-engines.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            assert "==" in line, f"requirements-engines.txt pins exactly: {line}"
            engines[_name(line)] = line
    assert set(engines) == extras["engines"], (
        "the engines extra and requirements-engines.txt name the same packages"
    )
    assert "scikit-learn" not in pinned  # never imported


def test_license_and_citation_match_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"]["text"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert (
        "Apache License" in text
        and "Version 2.0, January 2004" in text
        and "END OF TERMS AND CONDITIONS" in text
    )
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "Apache-2.0"
    assert cff["version"] == project["version"]
    paper = cff["preferred-citation"]
    assert paper["title"].startswith("JAGG: Jacobian-Aggregated Group Gradient")
    assert paper["year"] == 2026 and "2607.17572" in paper["url"]


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)
def test_no_tracked_file_is_a_symbolic_link():
    """Issue 58: a commit once tracked the ``.venv`` and ``cache`` links of a helper's worktree, and a clone got
    links into another machine's paths (mode 120000 in the index)."""
    index = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert index, "git ls-files listed nothing"
    links = [line.split("\t", 1)[1] for line in index if line.startswith("120000 ")]
    assert not links, f"tracked symbolic links: {links}"


# The largest file a commit may track: the committed results' records reach 2.2 MB (v4's seed-56 controls, from
# before records stopped storing other runs' results); a record that grows past this is growing by itself.
MAX_TRACKED_BYTES = 4 * 2**20


def test_no_tracked_file_outgrows_the_records():
    """Issue 56: records that stored each other's diffs doubled per run, and a stop's submission was refused for
    its size. Every tracked file stays under ``MAX_TRACKED_BYTES``."""
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    sizes = {n: (ROOT / n).stat().st_size for n in names if n and (ROOT / n).is_file()}
    assert sizes, "git ls-files listed nothing"
    assert not {n: b for n, b in sizes.items() if b > MAX_TRACKED_BYTES}


def test_every_driver_that_records_a_commit_declares_its_outputs():
    """Issue 58: a driver's own rewritten results must not make its record ``-dirty`` (``make table1`` from a
    fresh clone records a clean SHA): every ``run_metadata`` call in experiments/ passes ``outputs=``, and no
    driver reads the bare ``git_sha()``, which knows no outputs."""
    missing = []
    for path in sorted((ROOT / "experiments").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                keywords = {k.arg for k in node.keywords}
                if node.func.id == "run_metadata" and "outputs" not in keywords:
                    missing.append(f"{path.name}:{node.lineno} run_metadata without outputs=")
                elif node.func.id == "git_sha" and "ignore" not in keywords:
                    missing.append(f"{path.name}:{node.lineno} git_sha() without ignore=")
    assert not missing, missing
