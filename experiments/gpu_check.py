"""One-shot GPU check (``make gpu-check``): the update of one DanceGRPO trajectory on the real architectures.

For the day a GPU is lent (one GPU, at most ~8 minutes, no weights or downloads): random-init transformers with
the published FLUX.1-dev and Qwen-Image configs (``jagg.loop.plan.KNOWN_CONFIGS``), bf16 autocast, diffusers'
per-block gradient checkpointing, at the paper resolutions (Flux DanceGRPO 720 px = 90x90 latent; Qwen-Image
720 px and Flow-GRPO's 512 px = 64x64). For each, the backward of one DanceGRPO-structured trajectory
(16 steps, 9 random of the first 15 trained, W = 3, jagg_frac 0.6: 2 JAGG groups + 1 exact group) is timed with
``jagg.engine.routing.trajectory_backward`` for the exact strategy and JAGG in every ``ENDPOINT_MODES`` mode,
with and without the rollout's stored outputs (``outputs=``), with LoRA (r64 / alpha 128 on
``jagg.scale.lora.DEFAULT_TARGETS``) and with full-parameter gradients, and the peak GPU memory of each run is
recorded (``torch.cuda.max_memory_allocated``).

What "update" means here: the gradient computation of one micro-batch (forwards with autograd, signals,
transformer backward), which is the part JAGG changes; no optimizer step. Full-parameter runs keep weights and
gradients in bf16: fp32 master weights plus fp32 gradients of Qwen-Image (2 x 81.7 GB) do not fit one GPU
(FSDP2 shards them over 8 in training). LoRA runs keep the frozen base in bf16 and the adapters in fp32.
Random weights are drawn N(0, 1/fan_in) (norm scales 1, biases 0) directly on the device.

Without CUDA the same code runs on the tiny configs (``jagg.models.TINY_CONFIGS``, small latents) in seconds,
says so, and writes under ``runs/`` by default, so nothing under ``results/gpu/`` ever comes from a CPU.

    python experiments/gpu_check.py [--out results/gpu/gpu_check.csv] [--tiny] [--batch 1] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from pathlib import Path

import torch
from torch import nn

from jagg.common import atomic_write_text, command_line, run_metadata, set_threads, write_table
from jagg.config import AlgorithmConfig
from jagg.engine.algorithms import DanceGRPO
from jagg.engine.grpo import GRPOStepLoss
from jagg.engine.routing import Routing, trajectory_backward
from jagg.engine.sde import sde_step_with_logprob, shifted_linear_sigmas
from jagg.engine.strategies import ENDPOINT_MODES, group_backward
from jagg.loop.plan import KNOWN_CONFIGS, VAE_SCALE
from jagg.models import BACKBONES, TINY_CONFIGS, TextCond
from jagg.scale.distributed import materialize_tensor_attributes
from jagg.scale.lora import DEFAULT_TARGETS, apply_lora

GPU_OUT = "results/gpu/gpu_check.csv"
CPU_OUT = "runs/gpu_check/gpu_check.csv"  # runs/ is git-ignored
# DanceGRPO's trajectory (configs/paper/flux_dancegrpo.yaml): 16 steps, eta 0.3, shift 3, 60% of the first 15.
NUM_STEPS, ETA, SHIFT, TIMESTEP_FRACTION, CLIP = 16, 0.3, 3.0, 0.6, 1e-4
GROUP_SIZE, JAGG_FRAC = 3, 0.6
LORA_RANK, LORA_ALPHA = 64, 128
RESOLUTIONS = {"flux": (720,), "qwenimage": (720, 512)}  # px: DanceGRPO (both), Flow-GRPO Qwen-Image (512)
TEXT_TOKENS = {
    "flux": 512,
    "qwenimage": 128,
}  # Flux: T5 padded to 512 (DanceGRPO); Qwen-Image: unpadded prompt
TINY_LATENT = {720: 8, 512: 4}  # CPU stand-ins for 90x90 / 64x64 latents
TINY_TEXT_TOKENS = 8
# (strategy, endpoint mode, stored outputs); exact ignores the mode and the outputs.
VARIANTS = [("exact", "batched", False)] + [
    ("jagg", mode, stored) for mode in ENDPOINT_MODES for stored in (False, True)
]


def variant_name(strategy: str, endpoints: str, stored: bool) -> str:
    return "exact" if strategy == "exact" else f"jagg/{endpoints}" + ("+stored" if stored else "")


def default_out(cuda: bool) -> str:
    """results/gpu/ only for a CUDA run; a CPU run never writes there by default."""
    return GPU_OUT if cuda else CPU_OUT


# --------------------------------------------------------------------------- models
def _init_(model: nn.Module, seed: int) -> None:
    """Random weights in place on their device: matrices N(0, 1/fan_in), 1-d scales 1, biases 0."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()), generator=gen)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)


def build_transformer(
    name: str, config: dict, device: torch.device, dtype: torch.dtype, seed: int
) -> nn.Module:
    """The diffusers transformer of ``config``, built on the meta device and materialised on ``device``.

    Never holds an fp32 copy of the full model. Plain tensor attributes computed in ``__init__`` (Qwen-Image's
    RoPE tables) are not parameters or buffers; ``materialize_tensor_attributes`` recomputes them, as
    ``shard_from_rank0`` does on the ranks that built the model on the meta device.
    """
    cls = BACKBONES[name].transformer_cls
    with torch.device("meta"):
        model = cls.from_config(config).to(dtype)
    model = model.to_empty(device=device)
    materialize_tensor_attributes(model, device)  # the trainer's fix (jagg.scale.distributed)
    _init_(model, seed)
    model.enable_gradient_checkpointing()
    return model


# --------------------------------------------------------------------------- one trajectory
def make_trajectory(
    backbone, config: dict, name: str, latent: int, tokens: int, batch: int, device, seed: int
):
    """Bound velocity, stored latents / outputs of the trained steps, and the GRPO step loss (DanceGRPO)."""
    g = torch.Generator().manual_seed(seed)
    cond = TextCond(
        embeds=torch.randn(batch, tokens, config["joint_attention_dim"], generator=g),
        mask=torch.ones(batch, tokens, dtype=torch.long),
        pooled=torch.randn(batch, config["pooled_projection_dim"], generator=g)
        if "pooled_projection_dim" in config
        else None,
    ).to(device=device, dtype=next(backbone.parameters()).dtype)
    velocity = backbone.bind(cond)
    alg = DanceGRPO(AlgorithmConfig(name="dancegrpo", sde_kind="dance", timestep_fraction=TIMESTEP_FRACTION))
    steps = alg.trained_steps(alg.step_kinds(NUM_STEPS, g), batch, g).T  # (T, B), sorted by time
    sig = shifted_linear_sigmas(NUM_STEPS, SHIFT).float()
    sigma, sigma_next = sig[steps], sig[steps + 1]  # (T, B)
    channels = backbone.latent_channels
    x0, eps = (torch.randn(batch, channels, latent, latent, generator=g) for _ in range(2))
    s = sigma.view(*sigma.shape, 1, 1, 1)
    x = ((1 - s) * x0 + s * eps).to(device)  # a straight-path stand-in for the rollout's latents
    sigma, sigma_next = sigma.to(device), sigma_next.to(device)
    outputs, x_next, old = [], [], []
    with torch.no_grad(), _autocast(device):
        for i in range(x.shape[0]):
            v = velocity(x[i], sigma[i]).float()
            step = sde_step_with_logprob(x[i], v, sigma[i], sigma_next[i], kind="dance", noise_level=ETA)
            outputs.append(v)
            x_next.append(step.prev_sample)
            old.append(step.log_prob)
    loss = GRPOStepLoss(
        x=x,
        x_next=torch.stack(x_next),
        sigma=sigma,
        sigma_next=sigma_next,
        old_log_prob=torch.stack(old),
        advantages=torch.randn(batch, generator=g).to(device),
        kind="dance",
        noise_level=ETA,
        clip_range=CLIP,
        scale=1.0 / x.shape[0],
    )
    return velocity, x, sigma, torch.stack(outputs), loss


def _autocast(device):
    """bf16 autocast on CUDA; off on the CPU (CPU bf16 kernels would make the tiny smoke run slow)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(model: nn.Module | None, device) -> None:
    if model is not None:
        model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_variants(model, velocity, x, sigma, outputs, loss, device, deadline: float) -> list[dict]:
    """Time ``trajectory_backward`` for every variant (after a short untimed warm-up) and record peak memory."""
    with _autocast(device):  # kernels and allocator, outside the timing
        group_backward(velocity, x[:1], sigma[:1], loss, "exact")
        group_backward(
            velocity, x[:GROUP_SIZE], sigma[:GROUP_SIZE], loss, "jagg", outputs=outputs[:GROUP_SIZE]
        )
    rows = []
    for strategy, endpoints, stored in VARIANTS:
        row = dict(
            variant=variant_name(strategy, endpoints, stored), strategy=strategy, stored_outputs=stored
        )
        row["endpoints"] = "" if strategy == "exact" else endpoints
        if time.perf_counter() > deadline:
            rows.append({**row, "status": "skipped (time budget)"})
            continue
        _free(model, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else float("nan")
        try:
            _sync(device)
            t0 = time.perf_counter()
            with _autocast(device):
                stats = trajectory_backward(
                    velocity,
                    x,
                    sigma,
                    loss,
                    Routing(strategy=strategy, group_size=GROUP_SIZE, jagg_frac=JAGG_FRAC).plans(x.shape[0]),
                    endpoints=endpoints,
                    outputs=outputs if stored else None,
                )
            _sync(device)
            seconds = time.perf_counter() - t0
        except torch.OutOfMemoryError:
            rows.append({**row, "status": "out of memory"})
            continue
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = all(bool(torch.isfinite(gr).all()) for gr in grads) and math.isfinite(stats.loss)
        rows.append(
            {
                **row,
                "status": "ok" if finite else "ok (non-finite gradient)",
                "seconds": seconds,
                "forward_passes": stats.forward_passes,
                "forward_passes_with_grad": stats.forward_passes_with_grad,
                "backward_passes": stats.backward_passes,
                "backward_calls": stats.backward_calls,
                "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30
                if device.type == "cuda"
                else None,
                "resident_gib": resident / 2**30,
            }
        )
    exact = next((r for r in rows if r["variant"] == "exact" and "seconds" in r), None)
    for r in rows:
        if exact and "seconds" in r:
            r["speedup_vs_exact"] = exact["seconds"] / r["seconds"]
    return rows


# --------------------------------------------------------------------------- driver
def check_backbone(name: str, tiny: bool, device, batch: int, seed: int, deadline: float, log) -> list[dict]:
    config = TINY_CONFIGS[name]() if tiny else dict(KNOWN_CONFIGS[name])
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    transformer = build_transformer(name, config, device, dtype, seed)
    backbone = BACKBONES[name](transformer)
    n_params = sum(p.numel() for p in transformer.parameters())
    log(f"{name}: {n_params / 1e9:.2f}B parameters built on {device} in {time.perf_counter() - t0:.1f} s")
    rows = []
    for params in ("full", "lora"):
        if params == "lora":
            _free(transformer, device)
            apply_lora(transformer, LORA_RANK, LORA_ALPHA, DEFAULT_TARGETS[name])
        trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
        for px in RESOLUTIONS[name]:
            latent = TINY_LATENT[px] if tiny else px // VAE_SCALE
            tokens = TINY_TEXT_TOKENS if tiny else TEXT_TOKENS[name]
            head = dict(
                backbone=name,
                config="tiny" if tiny else "real",
                resolution_px=px,
                latent=f"16x{latent}x{latent}",
                image_tokens=(latent // 2) ** 2,
                text_tokens=tokens,
                batch=batch,
                params_b=n_params / 1e9,
                trainable_m=trainable / 1e6,
                gradients=params,
            )
            if time.perf_counter() > deadline:
                rows += [
                    {**head, "variant": variant_name(*v), "status": "skipped (time budget)"} for v in VARIANTS
                ]
                continue
            traj = make_trajectory(backbone, config, name, latent, tokens, batch, device, seed)
            for r in run_variants(transformer, *traj, device, deadline):
                rows.append({**head, **r})
                shown = f"{r['seconds']:.2f} s" if "seconds" in r else r["status"]
                mem = f", peak {r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else ""
                log(f"  {name} {px}px {params:<4} {r['variant']:<22} {shown}{mem}")
            del traj
    del backbone, transformer
    _free(None, device)
    return rows


def to_markdown(rows: list[dict], meta: dict, tiny: bool) -> str:
    lines = [
        "# GPU check: update of one DanceGRPO trajectory, exact vs JAGG endpoint modes",
        "",
        f"Hardware: {meta['hardware']}. git {meta['git_sha']}, torch {meta['versions']['torch']}.",
        f"Command: `{meta['command']}`",
        "",
    ]
    if tiny:
        lines += [
            "**Tiny configs, not the real architectures** (no CUDA or `--tiny`): the numbers only show that the",
            "script runs; they say nothing about GPU time or memory.",
            "",
        ]
    lines += [
        "Random-init transformers ("
        + ("tiny configs" if tiny else "FLUX.1-dev / Qwen-Image configs")
        + "), bf16",
        "autocast, gradient checkpointing; 16 steps, 9 random of the first 15 trained, W = 3, jagg_frac 0.6;",
        "gradient of one micro-batch (no optimizer step). `full`: every weight trained (bf16 weights and",
        "gradients); `lora`: r64 / alpha 128 on the Flow-GRPO targets (fp32 adapters, bf16 frozen base).",
        "`+stored`: intermediate outputs from the rollout. Peak = `torch.cuda.max_memory_allocated`.",
        "",
        "| backbone | px | gradients | trainable | variant | fwd (grad) | bwd passes | bwd calls | s "
        "| speed-up | peak GiB | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["backbone"], r["resolution_px"], r["gradients"], f"{r['trainable_m']:.1f}M", r["variant"]]
        if "seconds" in r:
            peak = r.get("peak_gib")
            cells += [
                f"{r['forward_passes']} ({r['forward_passes_with_grad']})",
                r["backward_passes"],
                r["backward_calls"],
                f"{r['seconds']:.2f}",
                f"{r['speedup_vs_exact']:.2f}x" if "speedup_vs_exact" in r else "",
                "" if peak is None else f"{peak:.1f}",
            ]
        else:
            cells += [""] * 6
        lines.append("| " + " | ".join(str(c) for c in [*cells, r["status"]]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help=f"CSV path (default {GPU_OUT} with CUDA, {CPU_OUT} without)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs even with CUDA (a quick smoke run)")
    ap.add_argument("--backbones", nargs="+", default=["flux", "qwenimage"], choices=sorted(BACKBONES))
    ap.add_argument("--batch", type=int, default=1, help="trajectories per micro-batch (DanceGRPO updates 1)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining runs after this many s")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    set_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    tiny = args.tiny or not cuda
    out = Path(args.out or default_out(cuda))
    if not cuda:
        print("gpu_check: no CUDA device: running the same code on the tiny configs on the CPU (seconds);")
        print(f"gpu_check: these are not GPU numbers, and they go to {out}, not {GPU_OUT}.")
    start = time.perf_counter()
    deadline = start + args.budget_s
    rows = []
    for name in args.backbones:
        rows += check_backbone(name, tiny, device, args.batch, args.seed, deadline, print)
    meta = run_metadata(
        command=command_line("experiments/gpu_check.py", argv),
        seed=args.seed,
        config=vars(args),
        tiny=tiny,
        device=str(device),
        wall_s=time.perf_counter() - start,
        trajectory=dict(
            num_steps=NUM_STEPS,
            eta=ETA,
            shift=SHIFT,
            timestep_fraction=TIMESTEP_FRACTION,
            group_size=GROUP_SIZE,
            jagg_frac=JAGG_FRAC,
            lora=(LORA_RANK, LORA_ALPHA),
        ),
        architectures="tiny" if tiny else {k: KNOWN_CONFIGS[k] for k in args.backbones},
    )
    write_table(rows, out, meta)
    md = to_markdown(rows, meta, tiny)
    atomic_write_text(out.with_suffix(".md"), md)
    print(md)
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.meta.json')} in {meta['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
