"""Benchmark: one group's backward, exact vs JAGG, on Flux- and Qwen-Image-architecture backbones.

For each backbone and W, the strategies run interleaved (alternating order) on the same group and the median
wall time is reported, with the speed-up predicted by pass counting from separately measured per-pass costs:
    exact = W (F_grad + B),   jagg = 2 F_grad + (W - 2) F_nograd + 2 B + W P
(F_grad / F_nograd: forward with / without autograd, B: one graph's backward, P: the per-step proxy signal).

    python experiments/bench_group_backward.py --out results/bench_group_backward.csv [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from jagg.common import atomic_write_text, command_line, run_metadata, set_threads, write_table
from jagg.engine.grpo import clipped_ppo_loss
from jagg.engine.sde import sde_step_with_logprob, shifted_linear_sigmas
from jagg.engine.strategies import group_backward
from jagg.models import TextCond, build_tiny_backbone

# A small but compute-bound size: ~0.6M parameters, 64 image tokens (16x16 latent of 16 channels).
BENCH_SIZES = {
    "flux": dict(
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=32,
        num_attention_heads=4,
        axes_dims_rope=(8, 12, 12),
    ),
    "qwenimage": dict(num_layers=4, attention_head_dim=32, num_attention_heads=4, axes_dims_rope=(8, 12, 12)),
}


def make_group(name: str, w: int, batch: int, size: int, seed: int):
    """Backbone, bound velocity, a straight-path group of latents (W, B, C, H, W) and a GRPO step loss."""
    bb = build_tiny_backbone(name, seed=seed, latent_channels=16, **BENCH_SIZES[name])
    g = torch.Generator().manual_seed(seed)
    cond = TextCond(
        embeds=torch.randn(batch, 16, 32, generator=g),
        mask=torch.ones(batch, 16, dtype=torch.long),
        pooled=torch.randn(batch, 32, generator=g),
    )
    velocity = bb.bind(cond)
    sig = shifted_linear_sigmas(w + 1, shift=3.0).float()  # W steps with a next time each
    x0, eps = torch.randn(2, batch, 16, size, size, generator=g)
    latents = torch.stack([(1 - t) * x0 + t * eps for t in sig[:w]])
    adv = torch.randn(batch, generator=g)
    with torch.no_grad():
        steps = [
            sde_step_with_logprob(
                latents[j],
                velocity(latents[j], sig[j]),
                sig[j],
                sig[j + 1],
                kind="dance",
                noise_level=0.3,
                generator=g,
            )
            for j in range(w)
        ]

    def step_loss(j, v):
        lp = sde_step_with_logprob(
            latents[j], v, sig[j], sig[j + 1], kind="dance", noise_level=0.3, prev_sample=steps[j].prev_sample
        ).log_prob
        return clipped_ppo_loss(lp, steps[j].log_prob, adv, clip_range=1e-4)[0]

    return bb, velocity, latents, sig[:w], step_loss


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def per_pass_costs(bb, velocity, latents, sigmas, step_loss, repeats: int) -> dict[str, float]:
    """Median seconds of: forward with grad, forward without grad, one backward, one proxy signal."""
    z, t = latents[0], sigmas[0]
    f_grad, f_nograd, bwd, proxy = [], [], [], []
    for _ in range(repeats):
        bb.zero_grad(set_to_none=True)
        f_nograd.append(_time(lambda: torch.no_grad()(velocity)(z, t)))
        t0 = time.perf_counter()
        v = velocity(z, t)
        f_grad.append(time.perf_counter() - t0)
        p = v.detach().requires_grad_(True)
        t0 = time.perf_counter()
        (s,) = torch.autograd.grad(step_loss(0, p), p)
        proxy.append(time.perf_counter() - t0)
        bwd.append(_time(lambda: torch.autograd.backward(v, s)))
    return {
        k: statistics.median(x)
        for k, x in zip(("f_grad", "f_nograd", "bwd", "proxy"), (f_grad, f_nograd, bwd, proxy))
    }


def bench_one(name: str, w: int, repeats: int, batch: int, size: int, seed: int) -> list[dict]:
    bb, velocity, latents, sigmas, step_loss = make_group(name, w, batch, size, seed)
    strategies = ("exact", "jagg")
    for s in strategies:  # warm-up (allocator, lazy init)
        group_backward(velocity, latents, sigmas, step_loss, s)
    times = {s: [] for s in strategies}
    stats = {}
    for r in range(repeats):
        for s in strategies if r % 2 == 0 else strategies[::-1]:
            bb.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            stats[s] = group_backward(velocity, latents, sigmas, step_loss, s)
            times[s].append(time.perf_counter() - t0)
    c = per_pass_costs(bb, velocity, latents, sigmas, step_loss, repeats)
    ideal = {
        "exact": w * (c["f_grad"] + c["bwd"] + c["proxy"]),
        "jagg": 2 * c["f_grad"] + (w - 2) * c["f_nograd"] + 2 * c["bwd"] + w * c["proxy"],
    }
    med = {s: statistics.median(times[s]) for s in strategies}
    rows = []
    for s in strategies:
        speedup, ideal_speedup = med["exact"] / med[s], ideal["exact"] / ideal[s]
        rows.append(
            dict(
                backbone=name,
                W=w,
                strategy=s,
                batch=batch,
                latent=f"16x{size}x{size}",
                params=sum(p.numel() for p in bb.parameters()),
                forward_passes=stats[s].forward_passes,
                forward_passes_with_grad=stats[s].forward_passes_with_grad,
                backward_passes=stats[s].backward_passes,
                backward_calls=stats[s].backward_calls,
                median_ms=1e3 * med[s],
                speedup=speedup,
                ideal_speedup=ideal_speedup,
                measured_over_ideal=speedup / ideal_speedup,
                fwd_grad_ms=1e3 * c["f_grad"],
                fwd_nograd_ms=1e3 * c["f_nograd"],
                bwd_ms=1e3 * c["bwd"],
                proxy_ms=1e3 * c["proxy"],
                repeats=repeats,
            )
        )
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    head = "| backbone | W | strategy | fwd (grad) | bwd passes | bwd calls | median ms | speed-up | ideal | measured/ideal |"
    lines = [
        "# One-group backward: exact vs JAGG",
        "",
        f"Hardware: {meta['hardware']}. git {meta['git_sha']}, torch {meta['versions']['torch']}, seed {meta['seed']}.",
        f"Command: `{meta['command']}`",
        "",
        head,
        "|---" * (head.count("|") - 1) + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backbone']} | {r['W']} | {r['strategy']} | {r['forward_passes']} ({r['forward_passes_with_grad']}) "
            f"| {r['backward_passes']} | {r['backward_calls']} | {r['median_ms']:.1f} | {r['speedup']:.2f}x "
            f"| {r['ideal_speedup']:.2f}x | {r['measured_over_ideal']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench_group_backward.csv")
    ap.add_argument("--backbones", nargs="+", default=["flux", "qwenimage"])
    ap.add_argument("--group-sizes", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--size", type=int, default=16, help="latent height = width (packed 2x2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="seconds-scale smoke run (tests)")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.size, args.group_sizes = 2, 4, [3]
    set_threads(1)
    torch.manual_seed(args.seed)
    rows = []
    for name in args.backbones:
        for w in args.group_sizes:
            rows += bench_one(name, w, args.repeats, args.batch, args.size, args.seed)
    meta = run_metadata(
        command=command_line("experiments/bench_group_backward.py", argv),
        seed=args.seed,
        config=vars(args),
        sizes=BENCH_SIZES,
    )
    write_table(rows, args.out, meta)
    md = to_markdown(rows, meta)
    atomic_write_text(Path(args.out).with_suffix(".md"), md)
    print(md)
    print(
        f"wrote {args.out}, {Path(args.out).with_suffix('.md')}, {Path(args.out).with_suffix('.meta.json')}"
    )


if __name__ == "__main__":
    main()
