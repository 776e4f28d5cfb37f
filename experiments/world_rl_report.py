"""Before/after sample grid and eval table of one world GRPO run; reads only the run directory.

python experiments/world_rl_report.py [--run runs/world/flux_dancegrpo]
    [--figure paper_figures/world_rl_before_after.png] [--markdown results/world_rl_eval.md]

The figure stacks the held-out sample grid of the first evaluation (iteration 0, the base model) above the
one of the last evaluation (same prompts, same fixed noise, ODE sampling); the markdown file gets the eval
numbers per evaluation iteration, cumulative training wall time, the command, git SHA and hardware.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def eval_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out, elapsed = [], 0.0
    for r in rows:
        elapsed += r.get("time_iteration_s", 0.0)
        if "eval_pref_mean" in r:
            out.append({**r, "train_elapsed_s": elapsed})
    return out


def figure(run: Path, path: Path) -> tuple[Path, Path]:
    from PIL import Image, ImageDraw

    grids = sorted((run / "samples").glob("iter_*.png"))
    first, last = grids[0], grids[-1]
    imgs = [Image.open(p).convert("RGB") for p in (first, last)]
    labels = [f"before: {first.stem} (base model)", f"after: {last.stem} (GRPO)"]
    w = max(i.width for i in imgs)
    band = 24
    canvas = Image.new("RGB", (w, sum(i.height + band for i in imgs)), "white")
    y = 0
    draw = ImageDraw.Draw(canvas)
    for img, label in zip(imgs, labels):
        draw.text((4, y + 6), label, fill="black")
        canvas.paste(img, (0, y + band))
        y += img.height + band
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return first, last


def markdown(run: Path) -> str:
    meta = json.loads((run / "run.json").read_text())
    lines = [
        "| iteration | train wall s | eval pref | eval clip | eval attr | train pref | train attr |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in eval_rows(run):
        tp, ta = r.get("reward_pref_mean"), r.get("reward_attr_mean")
        lines.append(
            f"| {r['iteration']} | {r['train_elapsed_s']:.0f} | {r['eval_pref_mean']:.2f} | "
            f"{r['eval_clip_mean']:.3f} | {r['eval_attr_mean']:.3f} | "
            f"{'-' if tp is None else f'{tp:.2f}'} | {'-' if ta is None else f'{ta:.3f}'} |"
        )
    lines += [
        "",
        f"command: `{' '.join(meta.get('argv', []))}`; git {meta['git_sha']}; {meta['hardware']}; "
        f"torch {meta['versions']['torch']}",
    ]
    return "\n".join(lines) + "\n"


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
        Path(args.markdown).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
