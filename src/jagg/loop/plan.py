"""``python -m jagg.train --dry-run``: what a config will do, computed without weights or downloads.

The transformer is built from its config on the meta device (no memory, no weights): the local
``model.path/transformer/config.json`` when present, otherwise the published FLUX.1-dev / Qwen-Image
architecture (``KNOWN_CONFIGS``). LoRA is applied on the meta model to count adapter parameters. The plan lists
the trained steps per sample, their groups and strategies (``jagg.engine.strategies.plan_groups``), the transformer
forward / backward passes per sample for the exact baseline and the configured strategy, and a per-rank memory
estimate under FSDP2 full sharding.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from jagg.config import Config

# transformer/config.json of the paper's models (diffusers layout), for dry runs without the files.
KNOWN_CONFIGS = {
    "flux": dict(  # black-forest-labs/FLUX.1-dev, 11.9B parameters
        patch_size=1,
        in_channels=64,
        num_layers=19,
        num_single_layers=38,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ),
    "qwenimage": dict(  # Qwen/Qwen-Image, 20.4B parameters
        patch_size=2,
        in_channels=64,
        out_channels=16,
        num_layers=60,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=3584,
        guidance_embeds=False,
        axes_dims_rope=(16, 56, 56),
    ),
}
VAE_SCALE = 8  # pixels per latent cell for both real VAEs
GIB = 2**30


@dataclass
class Plan:
    lines: list[str] = field(default_factory=list)

    def add(self, key: str, value) -> None:
        self.lines.append(f"  {key:<34} {value}")

    def section(self, title: str) -> None:
        self.lines.append(title)

    def __str__(self) -> str:
        return "\n".join(self.lines)


def transformer_config(cfg: Config) -> tuple[dict, str]:
    """(config dict, where it came from): a local pipeline's transformer config, else the known one."""
    path = cfg.model.path
    if cfg.model.source == "pretrained" and path and os.path.isdir(os.path.expanduser(path)):
        for sub in ("transformer", ""):
            f = os.path.join(os.path.expanduser(path), sub, "config.json")
            if os.path.isfile(f):
                with open(f) as fh:
                    data = json.load(fh)
                return {k: v for k, v in data.items() if not k.startswith("_")}, f
    if cfg.model.source != "pretrained":
        from jagg.world import World
        from jagg.world.pretrained import world_backbone_config

        return world_backbone_config(cfg.model.backbone, World()), "the embedded world"
    return KNOWN_CONFIGS[cfg.model.backbone], f"known {cfg.model.backbone} architecture"


def meta_transformer(cfg: Config):
    """The transformer (with LoRA when configured) on the meta device: parameter counts without memory."""
    from jagg.models import BACKBONES
    from jagg.scale.lora import DEFAULT_TARGETS, apply_lora

    config, source = transformer_config(cfg)
    cls = BACKBONES[cfg.model.backbone].transformer_cls
    m = cfg.model
    with torch.device("meta"):
        model = cls.from_config(config)
        if m.lora_rank > 0:
            apply_lora(model, m.lora_rank, m.lora_alpha, m.lora_targets or DEFAULT_TARGETS[m.backbone])
    return model, source


def trained_steps_per_sample(cfg: Config) -> int:
    """T: how many steps of one trajectory are trained (drawn once with a fixed generator)."""
    from jagg.engine.algorithms import ALGORITHMS

    alg = ALGORITHMS[cfg.algorithm.name](cfg.algorithm)
    gen = torch.Generator().manual_seed(0)
    kinds = alg.step_kinds(cfg.sampling.num_steps, gen)
    return int(alg.trained_steps(kinds, 1, gen).shape[1])


def build_plan(cfg: Config, world_size: int = 1) -> Plan:
    """The dry-run report for ``cfg`` on ``world_size`` ranks (see the module docstring)."""
    from jagg.engine.strategies import ENDPOINT_MODES, plan_groups, trajectory_cost

    m, s, a, b, t = cfg.model, cfg.sampling, cfg.algorithm, cfg.backward, cfg.train
    p = Plan()
    n_global = t.prompts_per_iter * t.images_per_prompt
    p.section("run")
    p.add("backbone / source", f"{m.backbone} / {m.source}" + (f" ({m.path})" if m.path else ""))
    p.add("algorithm / SDE", f"{a.name} / {a.sde_kind} noise {a.noise_level}, clip eps {a.clip_range}")
    res = s.latent_size * VAE_SCALE if m.source == "pretrained" else s.latent_size
    p.add(
        "image / latent",
        f"{res} px / (16, {s.latent_size}, {s.latent_size}), {(s.latent_size // 2) ** 2} tokens",
    )
    p.add("schedule", f"{s.num_steps} steps ({s.schedule}), eval {s.eval_num_steps}")
    p.add("world size", world_size)
    p.add(
        "samples per iteration",
        f"{n_global} = {t.prompts_per_iter} prompts x {t.images_per_prompt} images; {n_global // world_size} "
        f"per rank in micro-batches of {t.train_batch_size}, step every {t.grad_accum}",
    )
    p.add("precision / grad checkpointing", f"{t.precision} / {m.gradient_checkpointing}")
    p.add("LoRA", f"rank {m.lora_rank}, alpha {m.lora_alpha}" if m.lora_rank else "none (full fine-tuning)")
    rewards = ", ".join(
        f"{k} x {v}" + (f" {cfg.reward.kwargs[k]}" if k in cfg.reward.kwargs else "")
        for k, v in cfg.reward.weights.items()
    )
    p.add("train reward / eval", f"{rewards} / {', '.join(cfg.reward.eval)}")

    T = trained_steps_per_sample(cfg)
    groups = plan_groups(T, b.group_size, b.jagg_frac, b.strategy)
    p.section(
        f"update (backward.strategy={b.strategy}, W={b.group_size}, jagg_frac={b.jagg_frac}, "
        f"endpoints={b.endpoints}, reuse_rollout={b.reuse_rollout})"
    )
    p.add("trained steps per sample", f"{T} of {s.num_steps}")
    for g, plan in enumerate(groups):
        p.add(f"group {g}", f"steps {list(plan.steps)} -> {plan.strategy}")
    n_micro = max(1, t.prompts_per_iter * t.images_per_prompt // world_size // t.train_batch_size)
    reused = min(n_micro, t.grad_accum) if b.reuse_rollout else 0
    p.add(
        "stored rollout outputs used",
        f"{reused} of {n_micro} micro-batches per iteration (before the 1st step)",
    )
    cfg_mult = 2 if m.backbone == "qwenimage" and m.true_cfg_scale > 1 else 1
    route = dict(group_size=b.group_size, jagg_frac=b.jagg_frac)
    exact = trajectory_cost(T, strategy="exact", **route)
    p.section(
        "cost per sample by endpoint mode (passes of one micro-batch; FSDP2 collectives per sharded unit;"
        + (" x2 transformer calls with true CFG;" if cfg_mult > 1 else "")
        + " * = configured)"
    )
    p.lines.append(
        f"    {'mode':<26}{'forwards (grad)':>16}{'bwd passes':>11}{'bwd calls':>10}"
        f"{'all-gathers':>12}{'reduce-scat.':>13}{'graphs alive':>13}"
    )
    rows = [("exact", exact, b.strategy == "exact")]
    if b.strategy != "exact":
        for mode in ENDPOINT_MODES:
            for reuse in (False, True):
                c = trajectory_cost(T, strategy=b.strategy, endpoints=mode, reuse_outputs=reuse, **route)
                mark = mode == b.endpoints and reuse == (reused > 0)
                rows.append((f"{b.strategy}/{mode}" + ("+stored" if reuse else ""), c, mark))
    for name, c, mark in rows:
        p.lines.append(
            f"  {'*' if mark else ' '} {name:<26}{f'{c.forward_passes} ({c.forward_passes_with_grad})':>16}"
            f"{c.backward_passes:>11}{c.backward_calls:>10}{c.all_gathers:>12}{c.reduce_scatters:>13}"
            f"{c.graphs_alive:>13}"
        )
    ours = trajectory_cost(T, strategy=b.strategy, endpoints=b.endpoints, reuse_outputs=reused > 0, **route)
    p.add("backward passes saved", f"{1 - ours.backward_passes / exact.backward_passes:.0%}")
    p.add(
        "update time saved (pass counting, bwd = 2 fwd)",
        f"{1 - ours.time() / exact.time():.0%} with stored outputs, "
        f"{1 - trajectory_cost(T, strategy=b.strategy, endpoints=b.endpoints, **route).time() / exact.time():.0%} without",
    )
    p.add("rollout forwards per sample", s.num_steps * cfg_mult)
    _memory(
        p,
        cfg,
        world_size,
        graphs=ours.graphs_alive,
        held_grad=b.strategy != "exact" and b.endpoints == "joint",
    )
    return p


def _memory(p: Plan, cfg: Config, world_size: int, graphs: int, held_grad: bool) -> None:
    model, source = meta_transformer(cfg)
    n_all = sum(x.numel() for x in model.parameters())
    n_train = sum(x.numel() for x in model.parameters() if x.requires_grad)
    blocks = [*getattr(model, "transformer_blocks", []), *getattr(model, "single_transformer_blocks", [])]
    n_block = max((sum(x.numel() for x in blk.parameters()) for blk in blocks), default=0)
    t = cfg.train
    store = 8 if t.precision == "fp64" else 4  # bf16 = autocast over fp32 master weights
    compute = 2 if t.precision == "bf16" else store
    r = world_size
    params, grads, adam = n_all * store / r, n_train * store / r, 2 * n_train * 4 / r
    ema = n_train * store / r if cfg.optim.ema_decay > 0 else 0
    gathered = 2 * n_block * compute  # two unsharded blocks in flight (current + prefetch)
    p.section(f"memory per rank (FSDP2 full shard over {r}; transformer from {source}, no weights read)")
    p.add("parameters", f"{n_all / 1e9:.2f}B total, {n_train / 1e6:.1f}M trainable")
    p.add("weights (sharded)", f"{params / GIB:.1f} GiB")
    p.add("gradients (sharded)", f"{grads / GIB:.1f} GiB")
    p.add("AdamW state (sharded)", f"{adam / GIB:.1f} GiB" + (f" + EMA {ema / GIB:.1f} GiB" if ema else ""))
    p.add("unsharded blocks in flight", f"{gathered / GIB:.2f} GiB")
    # joint endpoints under FSDP2: the later graph's gradient for a unit waits unsharded (autograd buffers) until
    # the earlier graph reaches that unit; summed over the backward that is up to every trainable parameter.
    held = n_train * compute if held_grad else 0
    if held:
        p.add("unsharded gradients held (joint)", f"up to {held / GIB:.1f} GiB (batched/sequential: 0)")
    p.add("total before activations", f"{(params + grads + adam + ema + gathered + held) / GIB:.1f} GiB")
    hidden = model.config.num_attention_heads * model.config.attention_head_dim
    s = cfg.sampling
    txt = cfg.model.max_sequence_length if cfg.model.backbone == "flux" else 64
    tokens = (s.latent_size // 2) ** 2 + txt
    per_graph = t.train_batch_size * tokens * hidden * len(blocks) * compute
    p.add(
        "activations",
        f"~{per_graph / GIB:.2f} GiB per forward graph with gradient checkpointing (block inputs only; "
        f"{tokens} tokens x {hidden} x {len(blocks)} blocks x batch {t.train_batch_size}); the exact backward "
        f"holds 1 graph at a time, the configured strategy and mode up to {graphs}"
        + ("" if cfg.model.gradient_checkpointing else "; without checkpointing ~10-20x more per graph"),
    )
