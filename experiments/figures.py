"""Regenerate every table and figure from results/ alone (no training, seconds).

python experiments/figures.py [--results results] [--figures paper_figures]   (make figures)
"""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parent

# (what, input under results/, figure under paper_figures/, driver, its function regenerate(input, figure))
TARGETS = [
    ("Theorem 1", "theorem1.csv", "theorem1.png", "theorem1.py", "plot"),
    ("Table 1", "table1.csv", "table1_update_reduction.png", "table1.py", "render"),
    ("cosine", "cosine.csv", "cosine_per_group.png", "cosine.py", "render"),
    ("reward curves", "curves", ".", "curves.py", "render"),  # one reward_curves_<recipe>.png per recipe
]


def regenerator(driver: str, name: str):
    """The drawing function ``name`` of the driver file (run as a file, not imported as a module: the
    drivers share code through ``jagg`` only, never through each other)."""
    return runpy.run_path(str(EXPERIMENTS / driver))[name]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results")
    ap.add_argument("--figures", default="paper_figures")
    args = ap.parse_args(argv)
    for what, source, figure, driver, name in TARGETS:
        path = Path(args.results) / source
        if path.is_file() or any(path.glob("*/*_seed*.csv")):
            regenerator(driver, name)(path, Path(args.figures) / figure)
            print(f"{what}: regenerated from {path} -> {Path(args.figures) / figure}")
        else:
            print(f"{what}: no {path} yet (run its make target first)")


if __name__ == "__main__":
    main()
