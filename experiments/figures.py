"""Regenerate every table and figure from results/ alone (no training, seconds).

python experiments/figures.py [--results results] [--figures paper_figures]   (make figures)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cosine  # noqa: E402
import curves  # noqa: E402
import table1  # noqa: E402
import theorem1  # noqa: E402

# (what, input under results/, figure under paper_figures/, regenerate(input, figure))
TARGETS = [
    ("Theorem 1", "theorem1.csv", "theorem1.png", theorem1.plot),
    ("Table 1", "table1.csv", "table1_update_reduction.png", table1.render),
    ("cosine", "cosine.csv", "cosine_per_group.png", cosine.render),
    ("reward curves", "curves", ".", curves.render),  # one reward_curves_<recipe>.png per recipe
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results")
    ap.add_argument("--figures", default="paper_figures")
    args = ap.parse_args(argv)
    for what, source, figure, regenerate in TARGETS:
        path = Path(args.results) / source
        if path.is_file() or any(path.glob("*/*_seed*.csv")):
            regenerate(path, Path(args.figures) / figure)
            print(f"{what}: regenerated from {path} -> {Path(args.figures) / figure}")
        else:
            print(f"{what}: no {path} yet (run its make target first)")


if __name__ == "__main__":
    main()
