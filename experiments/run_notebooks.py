"""Execute the notebooks in place, so that a reader browsing the repository sees their outputs and figures.

    explore_results.ipynb         tables and small figures read from results/ alone (nothing trains)
    jagg_group_walkthrough.ipynb  one JAGG group built by hand: the world-pretrained backbone when
                                  `make pretrain` has cached it, else a random-init one (model.source=tiny)

    python experiments/run_notebooks.py [--results results] [--source auto|world|tiny] [--out DIR] [NAME ...]
    (make notebooks) -> notebooks/*.ipynb with outputs

Outputs are kept small and stable: 72 dpi PNG figures, no timing metadata, one torch thread; the same inputs
give the same notebook. ``tests/test_notebooks.py`` runs the same ``execute`` on a temporary copy.
"""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("explore_results.ipynb", "jagg_group_walkthrough.ipynb")


def world_is_cached() -> bool:
    """Whether `make pretrain` has cached the world's Flux backbone and text encoder (up to date)."""
    from jagg.world.pretrained import is_up_to_date

    return is_up_to_date("flux") and is_up_to_date("text_encoder")


@contextmanager
def _environment(**values: str):
    """Set environment variables (inherited by the kernel) for the duration of the block."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _coalesce_streams(outputs: list) -> list:
    """Merge consecutive stdout (or stderr) outputs: how prints are split into messages depends on timing."""
    merged: list = []
    for out in outputs:
        prev = merged[-1] if merged else None
        if out.output_type == "stream" and prev is not None and prev.get("name") == out.name:
            prev.text += out.text
            continue
        merged.append(out)
    return merged


def execute(src: Path, dst: Path, *, results: Path, source: str, timeout: int = 600):
    """Run notebook ``src`` top to bottom and write it with its outputs to ``dst``; returns the notebook.

    The kernel runs in ``dst``'s folder with JAGG_ROOT (this repository), JAGG_RESULTS and JAGG_SOURCE set.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(src, as_version=4)
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    env = dict(
        JAGG_ROOT=str(ROOT),
        JAGG_RESULTS=str(Path(results).resolve()),
        JAGG_SOURCE=source,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONHASHSEED="0",
    )
    with _environment(**env):
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            record_timing=False,
            resources={"metadata": {"path": str(dst.resolve().parent)}},
        )
        client.execute()
    for cell in nb.cells:  # nothing that changes from run to run
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = _coalesce_streams(cell.outputs)
    nbformat.write(nb, dst)
    return nb


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=list(NOTEBOOKS))
    ap.add_argument("--results", default=str(ROOT / "results"))
    ap.add_argument(
        "--source",
        choices=("auto", "world", "tiny"),
        default="auto",
        help="walkthrough backbone; auto = world when cached, else tiny",
    )
    ap.add_argument("--out", default=None, help="write here instead of in place")
    args = ap.parse_args(argv)
    source = args.source
    if source == "auto":
        source = "world" if world_is_cached() else "tiny"
    for name in args.names:
        src = ROOT / "notebooks" / name
        dst = Path(args.out) / name if args.out else src
        execute(src, dst, results=Path(args.results), source=source)
        print(
            f"executed {src.relative_to(ROOT)} -> {dst} (results {args.results}, walkthrough source {source})"
        )


if __name__ == "__main__":
    main()
