"""How much of a prompt group's reward spread the trained steps' own noise carries (issue 56's mechanism): the
window amendment's rollouts on the base model, with the noise of the trained window drawn apart from the rest.

GRPO credits a group's reward differences to the log-probs of the trained steps. Under the window's rollout
(Flow-GRPO-Fast: flow_grpo's SDE at 0.9 on the 2 trained steps, ODE elsewhere, one initial noise per group) every
difference comes from the trained steps' noise; under the every-step rollout (DanceGRPO's SDE at eta 1 on steps
0-19) the 2 trained steps are 2 of 20 noisy ones. ``window2_dance`` trains window2's steps under that rollout;
this measures the share of its group's reward variance that those steps' noise carries.

Per group (a training prompt, one initial noise, a window of 2 steps starting in [0, 8]): ``--outer`` draws of
the noise of every step outside the window, each with ``--inner`` draws of the window's noise. By the law of
total variance the reward variance splits into ``within`` = E[Var(R | outer noise)] (the window's share) and
``between`` = Var(E[R | outer noise]); the one-way ANOVA estimates (within: the mean of the outer draws' sample
variances; between: the variance of their means less within / inner) are unbiased. Share = sum within / sum
(within + between) over groups, with a 95% bootstrap interval over groups. The window rollout is the control:
nothing outside its window is random, so its share is 1 up to the estimator's noise.

    python experiments/credit.py [--prompts 2 --outer 6 --inner 6]   (about 4 CPU-minutes)
    -> results/credit/credit.csv (one row per rollout x group), results/credit/credit.md
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from jagg.common import atomic_write_text, command_line, run_metadata, set_threads, write_table
from jagg.config import load_config
from jagg.engine.sde import sde_step_with_logprob
from jagg.loop.components import build_components
from jagg.loop.trainer import Trainer

CONFIG = "configs/world/curves_flux_every_step.yaml"
STEPS = 20  # the schedule's trained steps (21 sampling steps, the last one ODE)
WINDOW, RANGE = 2, (0, 10)  # window2's: 2 consecutive steps starting in [0, 8]
# rollout -> (SDE kind, noise level, the steps it samples with noise; None: the window's own). every_step: the
# every-step arms' rollout, which window2_dance trains window2's steps under; window: window2's (the control)
ROLLOUTS = {
    "every_step": ("dance", 1.0, range(STEPS)),
    "window": ("flow_grpo", 0.9, None),
}


@torch.no_grad()
def rewards_of(
    trainer: Trainer, prompt: str, x_T: torch.Tensor, kinds: list[str], level: float, eps
) -> np.ndarray:
    """The training reward of each trajectory of one group: initial noise ``x_T`` (C, H, W) for all, step i
    of trajectory b moving to mean + std x ``eps[i][b]`` (the SDE's own step, its noise given)."""
    batch = eps[0].shape[0]
    cond = trainer.comp.text_encoder.encode_prompts([prompt] * batch)
    velocity, sigmas = trainer.velocity(cond), trainer.sigmas
    x = x_T.expand(batch, *x_T.shape).clone()
    for i, kind in enumerate(kinds):
        v = velocity(x, sigmas[i])
        step = sde_step_with_logprob(
            x, v, sigmas[i], sigmas[i + 1], kind=kind, noise_level=level, prev_sample=x
        )
        x = (step.mean + step.std * eps[i].to(x)).to(x.dtype)  # std 0 on an ODE step
    images = trainer.comp.decode(x.float()).cpu()
    return trainer.sampler.train_reward(images, [prompt] * batch).double().numpy()


def split(r: np.ndarray) -> tuple[float, float]:
    """(within, between) of an (outer, inner) reward table: one-way ANOVA's unbiased components."""
    within = float(r.var(axis=1, ddof=1).mean())
    return within, float(r.mean(axis=1).var(ddof=1)) - within / r.shape[1]


def group_rows(trainer: Trainer, prompts: list[str], outer: int, inner: int, seed: int) -> list[dict]:
    """One row per (rollout, prompt, window start): the reward table's within / between components."""
    gen = torch.Generator().manual_seed(seed)
    shape, rows = trainer.comp.latent_shape, []
    n = len(trainer.sigmas) - 1
    for start in range(RANGE[0], RANGE[1] - WINDOW + 1):
        window = range(start, start + WINDOW)
        for p, prompt in enumerate(prompts):
            x_T = torch.randn(shape, generator=gen)
            out_eps = torch.randn(n, outer, *shape, generator=gen)
            in_eps = torch.randn(n, outer * inner, *shape, generator=gen)
            # trajectory b = (k, j): every step outside the window takes outer draw k, the window's steps their
            # own draw (nested: fresh for every k too, so the ANOVA estimates are unbiased)
            eps = [in_eps[i] if i in window else out_eps[i].repeat_interleave(inner, 0) for i in range(n)]
            for name, (kind, level, noisy) in ROLLOUTS.items():
                kinds = [kind if i in (noisy if noisy is not None else window) else "ode" for i in range(n)]
                r = rewards_of(trainer, prompt, x_T, kinds, level, eps).reshape(outer, inner)
                within, between = split(r)
                rows.append(
                    dict(
                        rollout=name,
                        prompt=p,
                        window_start=start,
                        within=within,
                        between=between,
                        reward_mean=float(r.mean()),
                        reward_sd=float(r.std(ddof=1)),
                    )
                )
    return rows


def share(rows: list[dict], n_boot: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """sum within / sum (within + between) over the groups ``rows``, with a 95% bootstrap over groups."""
    w = np.array([r["within"] for r in rows])
    t = w + np.array([r["between"] for r in rows])
    draws = np.random.default_rng(seed).integers(len(w), size=(n_boot, len(w)))
    lo, hi = np.percentile(w[draws].sum(1) / t[draws].sum(1), [2.5, 97.5])
    return float(w.sum() / t.sum()), float(lo), float(hi)


def render(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "# Whose noise moves the group's reward (experiments/credit.py)",
        "",
        f"Base model of `{args.config}`, training reward, {args.prompts} training prompts x 9 windows of {WINDOW} steps "
        f"(starts 0-8) per rollout, {args.outer} draws of the noise outside the window x {args.inner} of the "
        "window's per group (one initial noise per group, as in training). Share: the part of the group's reward "
        "variance that the window's own noise carries (law of total variance, ANOVA estimates), pooled over "
        "groups, 95% bootstrap interval over groups. The window rollout's share is 1 by construction (no other "
        "step is random): it checks the estimator. `every_step`: DanceGRPO's SDE at eta 1 on steps 0-19 (the "
        "every-step arms' rollout, under which window2_dance trains window2's steps); `window`: flow_grpo's SDE at "
        "0.9 on the window only (window2's rollout).",
        "",
        "| rollout | groups | window's share of the reward variance | reward SD in a group | mean reward |",
        "|---|---|---|---|---|",
    ]
    for name in ROLLOUTS:
        mine = [r for r in rows if r["rollout"] == name]
        value, lo, hi = share(mine)
        sd = np.sqrt(np.mean([r["reward_sd"] ** 2 for r in mine]))
        mean = np.mean([r["reward_mean"] for r in mine])
        lines.append(f"| {name} | {len(mine)} | {value:.3f} [{lo:.3f}, {hi:.3f}] | {sd:.3f} | {mean:.3f} |")
    lines += ["", "By window start (every-step rollout):", "", "| start | share |", "|---|---|"]
    first = next(iter(ROLLOUTS))
    for start in range(RANGE[0], RANGE[1] - WINDOW + 1):
        mine = [r for r in rows if r["rollout"] == first and r["window_start"] == start]
        w, t = sum(r["within"] for r in mine), sum(r["within"] + r["between"] for r in mine)
        lines.append(f"| {start} | {w / t:.3f} |")
    return "\n".join(lines + [""])


# What this driver rewrites:
# left out of the meta's dirty check (jagg.common.tree_state).
OUTPUTS = ("results/credit/*",)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2, help="training prompts per window start")
    ap.add_argument("--outer", type=int, default=6, help="draws of the noise outside the window per group")
    ap.add_argument("--inner", type=int, default=6, help="draws of the window's noise per outer draw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--out", default="results/credit/credit.csv")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    for key in ("prompts", "outer", "inner"):
        if getattr(args, key) < (1 if key == "prompts" else 2):
            ap.error(f"--{key} must be >= {1 if key == 'prompts' else 2}")  # exits 2
    set_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(args.config, [f"train.seed={args.seed}", f"log.run_dir={tmp}", *args.overrides])
        trainer = Trainer(cfg, build_components(cfg), tmp)
        prompts = trainer.comp.train_prompts[: args.prompts]
        rows = group_rows(trainer, prompts, args.outer, args.inner, args.seed)
    out = Path(args.out)
    meta = run_metadata(
        outputs=OUTPUTS,
        command=command_line("experiments/credit.py", argv),
        seeds=[args.seed],
        config=args.config,
    )
    write_table(rows, out, meta)
    atomic_write_text(out.with_suffix(".md"), render(rows, args))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
