"""Benchmark: one group's backward, exact vs every JAGG graph mode, with and without stored outputs.

For each backbone and W, the variants (``variants(W)``, backward settings) run interleaved (rotating order) on the same group and the
median wall time is reported, with the speed-up predicted by pass counting (the cost model
``BackwardSetting.cost``) from separately measured per-pass costs:
    time = F_grad * forwards with grad + F_nograd * forwards without grad + B * backward passes + W * P
(F_grad / F_nograd: forward of B samples with / without autograd, B: one B-sample graph's backward, P: the
per-step proxy signal; a batched endpoint forward of 2B samples counts as 2 forward passes). Also reported:
the peak bytes autograd saves for backward (``SavedActivationMeter``), relative to exact.
"Stored" variants take the intermediate outputs from the rollout (computed once, untimed, as a rollout does).

    python experiments/bench_group_backward.py --out results/bench_group_backward.csv [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from jagg.common import atomic_write_text, command_line, run_metadata, set_threads, write_table
from jagg.engine.grpo import GRPOStepLoss
from jagg.engine.profiling import SavedActivationMeter
from jagg.engine.routing import BackwardSetting, Routing
from jagg.engine.sde import shifted_linear_sigmas
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
# The exact baseline, the paper-literal JAGG (joint, forwards every step), and the other modes, with and without
# stored outputs; one group of W. The default of this repository is JAGG batched + stored.
MODES = [(mode, stored) for mode in ("joint", "batched", "sequential") for stored in (False, True)]


def variants(w: int) -> list[BackwardSetting]:
    """The compared settings of one group of ``w`` steps (labels: ``BackwardSetting.label``)."""
    group = lambda strategy: Routing(strategy=strategy, group_size=w, jagg_frac=1.0)  # noqa: E731
    exact = BackwardSetting(routing=group("exact"), stored_outputs=False)
    return [exact] + [
        BackwardSetting(routing=group("jagg"), graph_mode=m, stored_outputs=s) for m, s in MODES
    ]


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
    step_loss = GRPOStepLoss.on_policy(
        velocity,
        latents,
        sig[:w],
        sig[1 : w + 1],
        adv,
        kind="dance",
        noise_level=0.3,
        clip_range=1e-4,
        generator=g,
    )
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
    with torch.no_grad():  # what the rollout keeps (untimed)
        outputs = torch.stack([velocity(latents[j], sigmas[j]) for j in range(w)])

    settings = variants(w)

    def run(s: BackwardSetting):
        return s.backward(velocity, step_loss, outputs)

    for v in settings:  # warm-up (allocator, lazy init)
        run(v)
    times = {v: [] for v in settings}
    stats, peak = {}, {}
    for r in range(repeats):
        k = r % len(settings)
        for v in settings[k:] + settings[:k]:
            bb.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            stats[v] = run(v)
            times[v].append(time.perf_counter() - t0)
    for v in settings:
        bb.zero_grad(set_to_none=True)
        with SavedActivationMeter() as meter:
            run(v)
        peak[v] = meter.peak_bytes
    c = per_pass_costs(bb, velocity, latents, sigmas, step_loss, repeats)
    ideal = {}
    for v in settings:
        cost = v.cost(w, batch=latents.shape[1], stored_outputs=True)
        no_grad = cost.forward_passes - cost.forward_passes_with_grad
        ideal[v] = (
            cost.forward_passes_with_grad * c["f_grad"]
            + no_grad * c["f_nograd"]
            + cost.backward_passes * c["bwd"]
            + w * c["proxy"]
        )
    exact = settings[0]
    med = {v: statistics.median(times[v]) for v in settings}
    rows = []
    for v in settings:
        speedup, ideal_speedup = med[exact] / med[v], ideal[exact] / ideal[v]
        rows.append(
            dict(
                backbone=name,
                W=w,
                variant=v.label,
                strategy=v.routing.strategy,
                endpoints="" if v.routing.strategy == "exact" else v.graph_mode,  # the CSV's column names
                stored_outputs=v.stored_outputs,
                batch=batch,
                latent=f"16x{size}x{size}",
                params=sum(p.numel() for p in bb.parameters()),
                forward_passes=stats[v].forward_passes,
                forward_passes_with_grad=stats[v].forward_passes_with_grad,
                forward_calls=stats[v].forward_calls,
                backward_passes=stats[v].backward_passes,
                backward_calls=stats[v].backward_calls,
                median_ms=1e3 * med[v],
                speedup=speedup,
                ideal_speedup=ideal_speedup,
                measured_over_ideal=speedup / ideal_speedup,
                peak_saved_mb=peak[v] / 2**20,
                peak_saved_vs_exact=peak[v] / peak[exact],
                fwd_grad_ms=1e3 * c["f_grad"],
                fwd_nograd_ms=1e3 * c["f_nograd"],
                bwd_ms=1e3 * c["bwd"],
                proxy_ms=1e3 * c["proxy"],
                repeats=repeats,
            )
        )
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    head = (
        "| backbone | W | variant | fwd passes (grad) | fwd calls | bwd passes | bwd calls | median ms "
        "| speed-up | ideal | measured/ideal | saved activations vs exact |"
    )
    lines = [
        "# One-group backward: exact vs JAGG endpoint modes, with and without stored outputs",
        "",
        f"Hardware: {meta['hardware']}. git {meta['git_sha']}, torch {meta['versions']['torch']}, seed {meta['seed']}.",
        f"Command: `{meta['command']}`",
        "",
        "`jagg/joint` = the paper's recipe (every step forwarded, two endpoint graphs, one joint backward);",
        "`batched` = one forward over both endpoints (2B samples); `sequential` = one graph alive at a time;",
        "`+stored` = intermediate outputs from the rollout (no forward). Ideal = pass counting (`BackwardSetting.cost`)",
        "with per-pass costs measured separately; passes are in units of one B-sample evaluation.",
        "",
        head,
        "|---" * (head.count("|") - 1) + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backbone']} | {r['W']} | {r['variant']} | {r['forward_passes']} ({r['forward_passes_with_grad']}) "
            f"| {r['forward_calls']} | {r['backward_passes']} | {r['backward_calls']} | {r['median_ms']:.1f} "
            f"| {r['speedup']:.2f}x | {r['ideal_speedup']:.2f}x | {r['measured_over_ideal']:.2f} "
            f"| {r['peak_saved_vs_exact']:.2f} |"
        )
    return "\n".join(lines) + "\n"


# What make bench rewrites:
# left out of the meta's dirty check (jagg.common.tree_state).
OUTPUTS = ("results/bench_group_backward*",)


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
        outputs=OUTPUTS,
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
