"""`make pretrain`: train and cache the embedded world's text encoder, rewards and backbones, then write
results/world.md, results/world.json and paper_figures/world_samples_<backbone>.png; then the video world's
(text encoder, video_pref, tiny Wan) and results/world_video.md, results/world_video.json.

Idempotent: artefacts whose manifest matches the code's config are reused; when nothing was rebuilt and the
report exists, the run is a no-op. All math lives in ``jagg.world``; this file is plumbing and formatting.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from PIL import Image, ImageDraw

import jagg.loop.rewards  # noqa: F401  (fills the reward registry)
from jagg.common import command_line, tree_state
from jagg.rewards import build_reward
from jagg.world import World, default_cache_dir, load_pretrained
from jagg.world.build import (
    EVAL_SEED,
    SAMPLES_PER_PROMPT,
    hack_probe,
    pretrain_all,
    reference_rewards,
    world_rewards,
)
from jagg.world.pretrained import (
    ARTEFACTS,
    BACKBONE_NAMES,
    REPORTS,
    SAMPLE_SHIFT,
    SAMPLE_STEPS,
    VIDEO_ARTEFACTS,
    environment,
    read_manifest,
)
from jagg.world.train import sample_images
from jagg.world.video import VideoWorld
from jagg.world.video_train import motion_probe

GRID_SAMPLES = 8  # samples per held-out prompt in the figure
SCALE = 4  # nearest-neighbour upscaling of the 16x16 images in the figure


def sample_grid(world: World, name: str, cache: Path, path: Path) -> None:
    """One row per held-out prompt: its label, a clean render (reference), then base-model ODE samples."""
    backbone, text_encoder = load_pretrained(name, cache)
    prompts = world.heldout_prompts
    reps = [p for p in prompts for _ in range(GRID_SAMPLES)]
    samples = sample_images(backbone, text_encoder, world, reps, seed=7).view(
        len(prompts), GRID_SAMPLES, 3, 16, 16
    )
    refs = world.render(prompts, seed=7)
    s, pad, label_w = world.size * SCALE, 4, 190
    canvas = Image.new(
        "RGB", (label_w + (GRID_SAMPLES + 1) * (s + pad) + pad, len(prompts) * (s + pad) + pad), "white"
    )
    draw = ImageDraw.Draw(canvas)
    for r, p in enumerate(prompts):
        y = pad + r * (s + pad)
        draw.text((4, y + s // 2 - 6), p, fill="black")
        row = [refs[r]] + list(samples[r])
        for c, img in enumerate(row):
            tile = Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()).resize(
                (s, s), Image.NEAREST
            )
            canvas.paste(tile, (label_w + pad + c * (s + pad) + (pad if c else 0), y))
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)


@torch.no_grad()
def shape_confusion(world: World, name: str, cache: Path, attr_model) -> list[list[int]]:
    """Held-out shape confusion of a base backbone (rows: prompted shape, columns: classifier's reading)."""
    backbone, text_encoder = load_pretrained(name, cache)
    reps = [p for p in world.heldout_prompts for _ in range(SAMPLES_PER_PROMPT)]
    images = sample_images(backbone, text_encoder, world, reps, EVAL_SEED, SAMPLE_STEPS, SAMPLE_SHIFT)
    n = len(world.config.shapes)
    conf = torch.zeros(n, n, dtype=torch.long)
    for t, p in zip(
        world.labels(reps)[:, 1].tolist(), attr_model.predict(images)[:, 1].tolist(), strict=True
    ):
        conf[t, p] += 1
    return conf.tolist()


def provenance() -> dict:
    """The commit, with the diff when anything but this driver's own reports (``REPORTS``) is uncommitted."""
    sha, diff = tree_state(REPORTS)
    return {"git_sha": sha} | ({"git_diff": diff} if diff is not None else {})


def _fmt(x: float) -> str:
    return f"{x:.3f}"


def write_report(
    world: World, cache: Path, results: Path, figures: Path, build_seconds: float | None
) -> None:
    """results/world.json (numbers) and results/world.md (the quality report) from the cached manifests."""
    manifests = {n: read_manifest(n, cache) for n in ARTEFACTS}
    previous = results / "world.json"
    if build_seconds is None and previous.exists():  # report-only rerun: keep the last build's wall time
        build_seconds = json.loads(previous.read_text()).get("make_pretrain_seconds_this_run")
    rewards = world_rewards(cache)
    data = {
        **provenance(),
        "command": command_line("experiments/pretrain.py"),
        "seeds": {
            n: m["seed"] for n, m in manifests.items()
        },  # one per artefact (jagg.world.pretrained JUDGE_TRAIN / FLOW_TRAIN)
        "environment": environment(),
        "make_pretrain_seconds_this_run": build_seconds,
        "train_seconds_total": sum(m["train_seconds"] for m in manifests.values()),
        "world": {"config": manifests["attr"]["config"]["world"], "heldout_prompts": world.heldout_prompts},
        "reference_clean_renders_heldout": reference_rewards(world, rewards, world.heldout_prompts),
        "hack_probe_heldout": hack_probe(world, rewards, world.heldout_prompts),
        "artefacts": {n: {k: v for k, v in m.items() if k != "config"} for n, m in manifests.items()},
        "shape_confusion_heldout": {
            n: shape_confusion(world, n, cache, rewards["attr"].model) for n in BACKBONE_NAMES
        },
    }
    results.mkdir(parents=True, exist_ok=True)
    (results / "world.json").write_text(json.dumps(data, indent=2) + "\n")
    for name in BACKBONE_NAMES:
        sample_grid(world, name, cache, figures / f"world_samples_{name}.png")

    env, m = data["environment"], manifests
    c = data["world"]["config"]
    lines = [
        "# Embedded world: quality report",
        "",
        f"Generated by `make pretrain` (experiments/pretrain.py). git {data['git_sha']}; {env['hardware']}; "
        f"python {env['python']}, torch {env['torch']}, diffusers {env['diffusers']}.",
        f"Total training time of all artefacts: {data['train_seconds_total'] / 60:.1f} min"
        + (
            f"; wall time of the `make pretrain` run that built them: {build_seconds / 60:.1f} min."
            if build_seconds
            else "."
        ),
        "",
        "## World",
        f"{len(c['colors'])} colours x {len(c['shapes'])} shapes x {len(c['positions'])} positions = "
        f"{len(world.prompts)} prompts at {c['size']}x{c['size']} px (chance exact match 1/{len(world.prompts)}). "
        f"Colours {', '.join(c['colors'])}; shapes {', '.join(c['shapes'])}; positions {', '.join(c['positions'])}.",
        f"Held-out prompts ({len(world.heldout_prompts)}, never seen by the generators; every pair of their "
        f"attributes occurs in training): {'; '.join(world.heldout_prompts)}.",
        "Generators work in pixel space (latent = 2 * image - 1, 3 channels, 2x2-packed into 64 tokens).",
        "",
        "## Reward models (held-out renders: fresh seeds)",
        "| artefact | role | params | train s | final loss | held-out metric |",
        "|---|---|---|---|---|---|",
    ]
    roles = {
        "text_encoder": ("frozen text encoder of both backbones (CLIP text tower)", "top1_retrieval"),
        "clip": ("`clip` reward, CLIPScore analogue", "top1_retrieval"),
        "pref": ("`pref` reward, HPSv2.1 / PickScore analogue", "pair_accuracy"),
        "attr": ("`attr` reward / metric, GenEval analogue", "attr_accuracy"),
    }
    for n, (role, key) in roles.items():
        val = m[n]["metrics"][key]
        metric = f"exact match {_fmt(val['exact'])}" if key == "attr_accuracy" else f"{key} {_fmt(val)}"
        if key == "top1_retrieval":
            metric += f" (held-out prompts {_fmt(m[n]['metrics']['top1_retrieval_heldout_prompts'])})"
        lines.append(
            f"| {n} | {role} | {m[n]['num_params']:,} | {m[n]['train_seconds']:.0f} | "
            f"{m[n]['final_loss']:.4f} | {metric} |"
        )
    per = m["pref"]["metrics"]["pair_accuracy_by_degradation"]
    lines += [
        "",
        "`pref` pair accuracy by degradation of the rejected image: "
        + ", ".join(f"{k} {_fmt(v)}" for k, v in per.items())
        + ".",
        "",
        "Reward-hacking probe (held-out prompts, clean renders vs the same with a noisy background or pixel "
        "noise; mean reward):",
        "",
        "| images | clip | pref | attr | jpeg (-kB) |",
        "|---|---|---|---|---|",
    ]
    for v, r in data["hack_probe_heldout"].items():
        lines.append(
            f"| {v} | {_fmt(r['clip'])} | {_fmt(r['pref'])} | {_fmt(r['attr'])} | {_fmt(r['jpeg'])} |"
        )
    lines += [
        "",
        "## Base backbones (ODE sampling, "
        f"{m['flux']['metrics']['sampler']['steps']} steps, shifted-linear schedule with shift "
        f"{m['flux']['metrics']['sampler']['shift']})",
        "Attribute accuracy and rewards on held-out prompts "
        f"({m['flux']['metrics']['heldout_prompts']['n_samples']} samples) and, in brackets, on training prompts.",
        "",
        "| backbone | class | params | steps | train s | final loss | attr exact | colour | shape | position "
        "| clip | pref | jpeg (-kB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in BACKBONE_NAMES:
        h, t = m[n]["metrics"]["heldout_prompts"], m[n]["metrics"]["train_prompts"]
        ha, ta = h["attr_accuracy"], t["attr_accuracy"]
        cells = [f"{_fmt(ha[k])} ({_fmt(ta[k])})" for k in ("exact", "color", "shape", "position")]
        cells += [
            f"{_fmt(h['mean_reward'][k])} ({_fmt(t['mean_reward'][k])})" for k in ("clip", "pref", "jpeg")
        ]
        lines.append(
            f"| {n} | {m[n]['config']['transformer_class']} | {m[n]['num_params']:,} | "
            f"{m[n]['config']['train']['steps']} | {m[n]['train_seconds']:.0f} | {m[n]['final_loss']:.4f} | "
            + " | ".join(cells)
            + " |"
        )
    ref = data["reference_clean_renders_heldout"]
    lines += [
        f"| clean renders (ceiling) | - | - | - | - | - | {_fmt(ref['attr'])} | - | - | - | {_fmt(ref['clip'])} | "
        f"{_fmt(ref['pref'])} | {_fmt(ref['jpeg'])} |",
        "",
        "Colour and position are already right in almost every sample; the headroom for RL is the shape. "
        "Held-out shape confusion of the base samples (rows: prompted shape, columns: what `attr` reads; "
        f"shapes {', '.join(c['shapes'])}): "
        + "; ".join(f"{n} {data['shape_confusion_heldout'][n]}" for n in BACKBONE_NAMES)
        + ". Undecided blobs tend to be read as circles, so circle prompts score highest.",
        "",
        "Sample grids (held-out prompts; first column a clean render, then 8 base samples): "
        + ", ".join(f"`paper_figures/world_samples_{n}.png`" for n in BACKBONE_NAMES)
        + ".",
        "",
        "Seeds: "
        + ", ".join(f"{n} {m[n]['seed']}" for n in ARTEFACTS)
        + ". Full manifests (configs, versions, "
        "SHAs) in `cache/world/*.json`; all numbers in `results/world.json`.",
    ]
    lines += judge_section(world, m)
    (results / "world.md").write_text("\n".join(lines) + "\n")


def judge_section(world: World, m: dict) -> list[str]:
    """results/world.md's report on the eval-only attribute judge, from its manifest."""
    j, mj = m["attr_judge"]["metrics"], m["attr_judge"]

    def acc(d: dict) -> str:
        return f"{_fmt(d['exact'])} ({_fmt(d['color'])} / {_fmt(d['shape'])} / {_fmt(d['position'])})"

    lines = [
        "",
        "## Eval-only attribute judge (`attr_judge`)",
        f"`AttrJudge` ({mj['num_params']:,} params, {mj['train_seconds']:.0f} s): CoordConv input, 5x5 / 3x3 "
        "convolutions with max pooling and a dropout MLP (`attr`: a stride-2 GELU tower with average pooling), "
        f"seed {mj['seed']} (`attr`: {m['attr']['seed']}), trained on its own renders, half of them passed "
        "through the pretrained backbones (SDEdit from sigma in "
        f"{mj['config']['train']['sdedit_sigma']}), with its own augmentation. It is a metric only: "
        "`reward.weights` refuses it. Exact match (colour / shape / position in brackets) on fresh renders "
        "whose content is known:",
        "",
        "| images | attr_judge | attr |",
        "|---|---|---|",
    ]
    for key in [k for k in j if k == "clean_renders" or k.startswith("degraded_by_")]:
        lines.append(f"| {key.replace('_', ' ')} | {acc(j[key]['attr_judge'])} | {acc(j[key]['attr'])} |")
    per = j[f"agreement_on_{BACKBONE_NAMES[0]}_samples"]["n"] // len(world.prompts)
    lines += [
        "",
        f"On base-model samples (ODE, every prompt x {per}), whose content nobody labelled, the two judges' "
        "exact-match verdicts against the prompt:",
        "",
        "| samples of | attr_judge exact | attr exact | verdicts agree | Cohen's kappa |",
        "|---|---|---|---|---|",
    ]
    for n in BACKBONE_NAMES:
        a = j[f"agreement_on_{n}_samples"]
        lines.append(
            f"| {n} | {_fmt(a['exact_attr_judge'])} | {_fmt(a['exact_attr'])} | {_fmt(a['agree'])} | "
            f"{_fmt(a['kappa'])} |"
        )
    return lines


PROBED = ("video_pref", "frames_pref", "frames_clip", "frames_attr")  # with temporal: the motion probe


def write_video_report(cache: Path, results: Path, build_seconds: float | None) -> None:
    """results/world_video.json (the video artefacts' manifests) and results/world_video.md (their numbers)."""
    m = {n: read_manifest(n, cache) for n in VIDEO_ARTEFACTS}
    previous = results / "world_video.json"
    if build_seconds is None and previous.exists():
        build_seconds = json.loads(previous.read_text()).get("make_pretrain_seconds_this_run")
    probe = {n: build_reward(n, cache_dir=cache) for n in PROBED} | {"temporal": build_reward("temporal")}
    data = {
        **provenance(),
        "command": command_line("experiments/pretrain.py"),
        "environment": environment(),
        "make_pretrain_seconds_this_run": build_seconds,
        "motion_probe": motion_probe(VideoWorld(), probe, seed=EVAL_SEED),
        "train_seconds_total": sum(a["train_seconds"] for a in m.values()),
        "artefacts": {n: {k: v for k, v in a.items() if k != "config"} for n, a in m.items()},
        "world": m["wan"]["config"]["world"],
    }
    results.mkdir(parents=True, exist_ok=True)
    previous.write_text(json.dumps(data, indent=2) + "\n")
    te, pref, wan = (m[n]["metrics"] for n in VIDEO_ARTEFACTS)
    env = data["environment"]
    lines = [
        "# Video world: quality report",
        "",
        f"Generated by `make pretrain` (experiments/pretrain.py) after the image world. git {data['git_sha']}; "
        f"{env['hardware']}; torch {env['torch']}, diffusers {env['diffusers']}. Training time of the video "
        f"artefacts: {data['train_seconds_total'] / 60:.1f} min"
        + (
            f"; wall time of the run that built them: {build_seconds / 60:.1f} min." if build_seconds else "."
        ),
        "",
        "| artefact | params | train s | final loss | held-out metric |",
        "|---|---|---|---|---|",
        f"| video_text_encoder | {m['video_text_encoder']['num_params']:,} | "
        f"{m['video_text_encoder']['train_seconds']:.0f} | {m['video_text_encoder']['final_loss']:.4f} | "
        f"top-1 prompt retrieval {_fmt(te['top1_retrieval'])} |",
        f"| video_pref | {m['video_pref']['num_params']:,} | {m['video_pref']['train_seconds']:.0f} | "
        f"{m['video_pref']['final_loss']:.4f} | pair accuracy {_fmt(pref['pair_accuracy'])} |",
        f"| wan (`{m['wan']['config']['transformer_class']}`) | {m['wan']['num_params']:,} | "
        f"{m['wan']['train_seconds']:.0f} | {m['wan']['final_loss']:.4f} | see below |",
        "",
        "`video_pref` pair accuracy by degradation: "
        + ", ".join(f"{k} {_fmt(v)}" for k, v in pref["pair_accuracy_by_degradation"].items())
        + ".",
        "",
        f"Base Wan, ODE sampling ({wan['sampler']['steps']} steps, shift {wan['sampler']['shift']}): the "
        "geometric judges (`motion_geom`: the motion; `video_geom`: colour, shape and motion), the temporal "
        "term and `video_pref`, against clean renders of the held-out prompts:",
        "",
        "| clips | n | motion_geom | video_geom | temporal | video_pref |",
        "|---|---|---|---|---|---|",
    ]
    for key in ("heldout_prompts", "train_prompts", "clean_renders_heldout"):
        r = wan[key]
        lines.append(
            f"| {key.replace('_', ' ')} | {r['n_samples']} | {_fmt(r['motion_geom'])} | {_fmt(r['video_geom'])} | "
            f"{_fmt(r['temporal'])} | {_fmt(r.get('video_pref', float('nan')))} |"
        )
    names = [*PROBED, "temporal"]
    lines += [
        "",
        "Which rewards see the motion (every prompt x 2; mean reward on clean clips, on the same clips moving the "
        "opposite way, and with the object standing still at its start):",
        "",
        "| clips | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for v, r in data["motion_probe"].items():
        lines.append(f"| {v.replace('_', ' ')} | " + " | ".join(_fmt(r[n]) for n in names) + " |")
    lines += ["", "Seeds: " + ", ".join(f"{n} {m[n]['seed']}" for n in VIDEO_ARTEFACTS) + "."]
    (results / "world_video.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=None, help="artefact dir (default cache/world)")
    ap.add_argument("--results", type=Path, default=Path("results"))
    ap.add_argument("--figures", type=Path, default=Path("paper_figures"))
    ap.add_argument("--force-report", action="store_true", help="rewrite the report even if nothing changed")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cache = Path(args.cache or default_cache_dir())
    t0 = time.perf_counter()
    rebuilt = pretrain_all(cache, log=print)
    seconds = time.perf_counter() - t0
    image = [n for n in rebuilt if n in ARTEFACTS]  # the image report is rewritten only when they changed
    outputs = [args.results / "world.md"] + [args.figures / f"world_samples_{n}.png" for n in BACKBONE_NAMES]
    if image or args.force_report or not all(p.exists() for p in outputs):
        write_report(World(), cache, args.results, args.figures, seconds if image else None)
        print(f"[pretrain] wrote {', '.join(map(str, outputs))}")
    video = [n for n in rebuilt if n in VIDEO_ARTEFACTS]
    if video or args.force_report or not (args.results / "world_video.md").exists():
        write_video_report(cache, args.results, seconds if video and not image else None)
        print(f"[pretrain] wrote {args.results / 'world_video.md'}")
    if not rebuilt and not args.force_report:
        print("[pretrain] nothing rebuilt: every artefact is up to date")


if __name__ == "__main__":
    main()
