"""What every figure carries: its hardware, scale and commit on the figure (shared by the drivers' plots)."""

from __future__ import annotations

import json
from pathlib import Path


def figure_footer(fig, meta: dict, scale: str, where: str | None = None) -> None:
    """Hardware, scale and commit under every figure (``meta``: a result's .meta.json; ``where`` replaces
    "Measured on <hardware>" for figures that are not, or not only, measurements)."""
    sha = str(meta.get("git_sha", "unknown"))[:7]
    where = where or f"Measured on {meta.get('hardware', '?')}"
    fig.text(0.005, 0.005, f"{where}; {scale}; git {sha}", fontsize=7, va="bottom")


def save_figure(fig, png: Path, dpi: int) -> None:
    """Write ``fig`` to ``png`` (its folder created) and close it."""
    import matplotlib.pyplot as plt

    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=dpi)
    plt.close(fig)


def world_scale(results: Path) -> str:
    """``embedded-world backbones (Flux ~1.02M, Qwen-Image ~1.06M parameters)`` from results/world.json."""
    path = results / "world.json"
    if not path.is_file():
        return "embedded-world backbones (CPU scale)"
    arts = json.loads(path.read_text())["artefacts"]
    sizes = ", ".join(
        f"{name} ~{arts[key]['num_params'] / 1e6:.2f}M"
        for key, name in (("flux", "Flux"), ("qwenimage", "Qwen-Image"))
    )
    return f"embedded-world backbones ({sizes} parameters)"
