"""Before/after sample grid and eval table of one world GRPO run; reads only the run directory.

python experiments/world_rl_report.py [--run runs/world/flux_dancegrpo]
    [--figure paper_figures/world_rl_before_after.png] [--markdown results/world_rl_eval.md]

The figure puts the held-out sample grid of the first evaluation (iteration 0, the base model) next to the
one of the last evaluation (same prompts, same fixed noise, ODE sampling), a prompt per row, every tile
underlined green / red by the ``attr`` metric when it was evaluated; the markdown file gets the eval
numbers per evaluation iteration, cumulative training wall time, a paired per-sample before/after comparison
(mean change, its standard error, sign test), the command, git SHA and hardware; beside it ``<name>.meta.json``
records the training run's run.json (command, seed, config, git SHA, versions, hardware, resumes) and this
report's own command and SHA.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from jagg.common import atomic_write_text, command_line, run_metadata
from jagg.ops.grids import GRID_COLS, GRID_PAD, GRID_ZOOM, grid_cell
from jagg.world.pretrained import REPORTS as WORLD_REPORTS


def eval_rows(run: Path) -> list[dict]:
    """The metrics rows that carry an evaluation, with the training wall time accumulated up to them."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out, elapsed = [], 0.0
    for r in rows:
        elapsed += r.get("time_iteration_s", 0.0)
        if any(k.startswith("eval_") for k in r):
            out.append({**r, "train_elapsed_s": elapsed})
    return out


def _mark_attr(img, scores: list[float]):
    """Underline every tile of a ``jagg.ops.grids.save_grid`` grid green (attr correct) or red (wrong)."""
    from PIL import ImageDraw

    z = GRID_ZOOM
    tile = img.width // (z * min(GRID_COLS, len(scores))) - GRID_PAD  # square tiles, before the zoom
    draw = ImageDraw.Draw(img)
    for i, ok in enumerate(scores):
        y, x = grid_cell(i, tile, tile)
        y, x = (y + tile) * z, x * z  # the padding strip just below the tile
        draw.rectangle([x, y, x + tile * z - 1, y + z - 2], fill=(40, 170, 60) if ok else (210, 40, 40))
    return img


def figure(run: Path, path: Path) -> tuple[Path, Path]:
    """Base-model grid and last grid side by side, one held-out prompt per row; tiles underlined green / red
    by the ``attr`` metric when the per-sample eval scores are there."""
    from PIL import Image, ImageDraw

    grids = sorted((run / "samples").glob("iter_*.png"))
    first, last = grids[0], grids[-1]
    imgs = [Image.open(p).convert("RGB") for p in (first, last)]
    scores = [run / "samples" / f"eval_{p.stem.split('_')[1]}.json" for p in (first, last)]
    scores = [json.loads(f.read_text()) if f.is_file() else None for f in scores]
    for img, sc in zip(imgs, scores):
        if sc and "attr" in sc:
            _mark_attr(img, sc["attr"])
    labels = [f"before: {first.stem} (base model)", f"after: {last.stem} (GRPO)"]
    prompts = scores[0]["prompts"] if scores[0] else []
    row_h = imgs[0].height // max(1, -(-len(prompts) // GRID_COLS)) if prompts else 0
    left, band, gap = (170 if prompts else 0), 24, 16
    w, h = imgs[0].width, max(i.height for i in imgs)
    canvas = Image.new("RGB", (left + 2 * w + gap, h + band), "white")
    draw = ImageDraw.Draw(canvas)
    for k, (img, label) in enumerate(zip(imgs, labels)):
        x = left + k * (w + gap)
        draw.text((x + 4, 6), label, fill="black")
        canvas.paste(img, (x, band))
    for r, prompt in enumerate(prompts[::GRID_COLS]):  # the first image of every grid row
        draw.text((4, band + r * row_h + row_h // 2 - 6), prompt, fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return first, last


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided sign test (McNemar for paired binary outcomes): P(as extreme | p = 1/2), ties dropped."""
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def paired_change(run: Path) -> list[str]:
    """Per-sample paired comparison of the last evaluation with the first (same prompts, same noise).

    For every eval reward: mean change +- its standard error over samples and the sign test over samples that
    changed (for ``attr``, samples fixed vs broken). Needs the ``samples/eval_*.json`` files the trainer writes.
    """
    files = sorted((run / "samples").glob("eval_*.json"))
    if len(files) < 2:
        return []
    first, last = (json.loads(f.read_text()) for f in (files[0], files[-1]))
    lines = [
        f"Paired change, {files[-1].stem} vs {files[0].stem} (same held-out prompts and noise, per sample):",
        "",
        "| reward | before | after | change | SE | samples up / down | sign-test p |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in (k for k in first if k != "prompts" and k in last):
        a, b = first[name], last[name]
        d = [y - x for x, y in zip(a, b)]
        n, mean = len(d), sum(d) / len(d)
        se = (sum((x - mean) ** 2 for x in d) / (n - 1) / n) ** 0.5 if n > 1 else float("nan")
        up, down = sum(x > 0 for x in d), sum(x < 0 for x in d)
        lines.append(
            f"| {name} | {sum(a) / n:.3f} | {sum(b) / n:.3f} | {mean:+.3f} | {se:.3f} | {up} / {down} | "
            f"{sign_test_p(up, down):.2g} |"
        )
    if "attr" in first and "attr_judge" in first:
        lines += ["", judges_line(first, last, files[0].stem, files[-1].stem)]
    return lines + [""]


def judges_line(first: dict, last: dict, first_name: str, last_name: str) -> str:
    """How often the training classifier (``attr``) and the eval-only judge (``attr_judge``) give the same
    verdict per sample, before and after; and the samples each says were fixed / broken."""

    def agree(s: dict) -> str:
        n = len(s["attr"])
        same = sum(a == j for a, j in zip(s["attr"], s["attr_judge"], strict=True))
        return f"{same} / {n}"

    moves = {
        k: (
            sum(a < b for a, b in zip(first[k], last[k], strict=True)),
            sum(a > b for a, b in zip(first[k], last[k], strict=True)),
        )
        for k in ("attr", "attr_judge")
    }
    return (
        f"Attribute judges: the training classifier `attr` and the eval-only `attr_judge` agree on "
        f"{agree(first)} samples at {first_name} and {agree(last)} at {last_name}; fixed / broken by `attr` "
        f"{moves['attr'][0]} / {moves['attr'][1]}, by `attr_judge` {moves['attr_judge'][0]} / "
        f"{moves['attr_judge'][1]}. An attribute gain counts only where `attr_judge` confirms it."
    )


def markdown(run: Path) -> str:
    meta = json.loads((run / "run.json").read_text())
    rows = eval_rows(run)
    names = [
        k[len("eval_") : -len("_mean")] for k in rows[0] if k.startswith("eval_") and k.endswith("_mean")
    ]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [
        "| iteration | train wall s | "
        + " | ".join(f"eval {n}" for n in names)
        + " | "
        + " | ".join(f"train {n}" for n in names)
        + " |",
        "|---|---|" + "---|" * (2 * len(names)),
    ]
    for r in rows:
        lines.append(
            f"| {r['iteration']} | {r['train_elapsed_s']:.0f} | "
            + " | ".join(fmt(r.get(f"eval_{n}_mean")) for n in names)
            + " | "
            + " | ".join(fmt(r.get(f"reward_{n}_mean")) for n in names)
            + " |"
        )
    lines += ["", *paired_change(run)]
    argv = list(meta.get("argv", []))
    if argv and argv[0].endswith("jagg/train.py"):  # recorded as sys.argv of `python -m jagg.train`
        argv[0] = "python -m jagg.train"
    lines += [
        f"command: `{' '.join(argv)}`; git {meta['git_sha']}; {meta['hardware']}; "
        f"torch {meta['versions']['torch']}",
    ]
    return "\n".join(lines) + "\n"


def provenance(run: Path, argv: list[str] | None) -> dict:
    """The metadata file of a report: this report's command, SHA, versions and hardware, the training run's
    seed, and its run.json in full (the run directory itself is not committed)."""
    training = json.loads((run / "run.json").read_text())
    return run_metadata(
        outputs=OUTPUTS,
        command=command_line("experiments/world_rl_report.py", argv),
        seed=training.get("seed"),
        training_run=training,
    )


# What make world-rl rewrites, and make pretrain's reports of the world it trains on:
# left out of the meta's dirty check (jagg.common.tree_state).
OUTPUTS = ("results/world_rl*", "paper_figures/world_rl_*", *WORLD_REPORTS)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/world/flux_dancegrpo")
    ap.add_argument("--figure", default="paper_figures/world_rl_before_after.png")
    ap.add_argument("--markdown", default=None, help="write the eval table here (default: print it)")
    args = ap.parse_args(argv)
    run = Path(args.run)
    first, last = figure(run, Path(args.figure))
    print(f"figure: {first.name} vs {last.name} -> {args.figure}")
    text = markdown(run)
    if args.markdown:
        atomic_write_text(args.markdown, text)
        meta = json.dumps(provenance(run, argv), indent=2, default=str) + "\n"
        atomic_write_text(Path(args.markdown).with_suffix(".meta.json"), meta)
    print(text)


if __name__ == "__main__":
    main()
