"""``python -m jagg.train --dry-run``: what a config will do, computed without weights or downloads.

The report has four parts: the run (backbone, algorithm, batch, precision, rewards); the pass plan
(``jagg.capacity.pass_plan``: the trained steps per sample, their groups and strategies, forward / backward passes
and collectives per graph mode); the memory plan per rank (``jagg.capacity.memory_model``: every term, and per GPU
size, 80 GB and 141 GB, whether the run fits); and the disk. The node itself (torch's CUDA build, the driver,
NCCL, the GPUs) is reported before it by ``jagg.ops.node``.
"""

from __future__ import annotations

import dataclasses

from jagg.capacity.memory_model import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT,
    GIB,
    GPU_SIZES_GB,
    PROMPT_LRU,
    MemoryPlan,
    all_gather_bytes,
    disk_plan,
    embedding_bytes,
    experts,
    memory_plan,
    meta_transformer,
    sequence_tokens,
)
from jagg.capacity.pass_plan import Report, add_pass_plan
from jagg.config import Config
from jagg.scale.architectures import VAE_SCALE, known_wan


def build_plan(cfg: Config, world_size: int = 1, ranks_per_node: int | None = None) -> Report:
    """The dry-run report for ``cfg`` on ``world_size`` ranks, ``ranks_per_node`` of them on each node (None: one
    node; see the module docstring)."""
    p = Report()
    add_run_section(p, cfg, world_size)
    ours = add_pass_plan(p, cfg, world_size)
    add_memory_section(
        p,
        cfg,
        world_size,
        graphs=ours.graphs_alive,
        held_grad=cfg.backward.planned_setting().holds_gradients,
        all_gathers=ours.all_gathers,
        ranks_per_node=ranks_per_node,
    )
    return p


def add_run_section(p: Report, cfg: Config, world_size: int) -> None:
    """Backbone, algorithm, image size, schedule, batch, precision, LoRA, rewards."""
    model, sampling, algorithm, train = cfg.model, cfg.sampling, cfg.algorithm, cfg.train
    n_global = train.prompts_per_iter * train.images_per_prompt
    p.section("run")
    p.add(
        "backbone / source", f"{model.backbone} / {model.source}" + (f" ({model.path})" if model.path else "")
    )
    p.add(
        "algorithm / SDE",
        f"{algorithm.name} / {algorithm.sde_kind} noise {algorithm.noise_level}, clip eps {algorithm.clip_range}",
    )
    h, w = sampling.latent_size, sampling.latent_width or sampling.latent_size
    scale = 1
    if model.source == "pretrained":
        scale = known_wan(model.path).vae_scale if model.backbone == "wan" else VAE_SCALE
    if model.backbone == "wan":  # the Wan VAE: 4 frames per latent frame after the first
        f = sampling.latent_frames
        p.add(
            "video / latent",
            f"{4 * (f - 1) + 1} frames of {h * scale}x{w * scale} px / (C, {f}, {h}, {w}), "
            f"{sequence_tokens(cfg)} tokens (text by cross-attention)",
        )
    else:
        p.add("image / latent", f"{h * scale}x{w * scale} px / (16, {h}, {w}), {(h // 2) * (w // 2)} tokens")
    p.add("schedule", f"{sampling.num_steps} steps ({sampling.schedule}), eval {sampling.eval_num_steps}")
    p.add("world size", world_size)
    p.add(
        "samples per iteration",
        f"{n_global} = {train.prompts_per_iter} prompts x {train.images_per_prompt} images; {n_global // world_size} "
        f"per rank in micro-batches of {train.train_batch_size}, step every {train.grad_accum}",
    )
    n_micro = max(1, n_global // world_size // train.train_batch_size)
    p.add(
        "optimizer steps per iteration",
        f"{-(-n_micro // train.grad_accum)} of up to {world_size * train.train_batch_size * train.grad_accum} "
        f"samples; reward std over "
        + (
            f"all {n_global} rewards"
            if algorithm.adv_std == "global"
            else f"each group of {train.images_per_prompt}"
        ),
    )
    base = "" if model.base_dtype == "compute" else f" (frozen base and VAE {model.base_dtype})"
    p.add("precision / grad checkpointing", f"{train.precision}{base} / {model.gradient_checkpointing}")
    p.add(
        "LoRA",
        f"rank {model.lora_rank}, alpha {model.lora_alpha}" if model.lora_rank else "none (full fine-tuning)",
    )
    rewards = ", ".join(
        f"{k} x {v}" + (f" {cfg.reward.kwargs[k]}" if k in cfg.reward.kwargs else "")
        for k, v in cfg.reward.weights.items()
    )
    p.add("train reward / eval", f"{rewards} / {', '.join(cfg.reward.eval)}")


def add_memory_section(
    p: Report,
    cfg: Config,
    world_size: int,
    graphs: int,
    held_grad: bool,
    all_gathers: int = 0,
    ranks_per_node: int | None = None,
) -> None:
    """The memory plan per rank (``jagg.capacity.memory_model``), the host, the all-gathers, export, then the disk."""
    model, source = meta_transformer(cfg)
    mp = memory_plan(cfg, world_size, graphs, held_grad, model)
    model_cfg, train, data = cfg.model, cfg.train, cfg.data
    n_all = experts(cfg) * sum(x.numel() for x in model.parameters())
    n_train = experts(cfg) * sum(x.numel() for x in model.parameters() if x.requires_grad)
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    layout = "full shard" if model_cfg.shard_frozen_base else "adapters sharded, frozen base replicated"
    p.section(
        f"memory per rank (FSDP2 {layout} over {world_size}; transformer from {source}, no weights read; "
        "GiB = 2^30 bytes)"
    )
    p.add("parameters", f"{n_all / 1e9:.2f}B total, {n_train / 1e6:.1f}M trainable")
    for key, b in mp.gpu.items():
        p.add(key, gib(b))
    if model_cfg.source == "pretrained":
        if data.precompute_embeddings:
            p.add("text encoders", "freed after precomputing (data.precompute_embeddings)")
        per_prompt = embedding_bytes(cfg, model)
        if data.embedding_cache:
            where = (
                f"on disk in data.embedding_cache={data.embedding_cache} (~{gib(per_prompt * 1e5)} per 1e5)"
            )
        elif data.precompute_embeddings:
            where = "ALL prompts in host memory on every rank: set data.embedding_cache"
        else:
            where = f"an in-memory LRU of {PROMPT_LRU} prompts per rank (host)"
        p.add("prompt embeddings: where", f"{per_prompt / 2**20:.2f} MiB per prompt; {where}")
    else:
        p.add("text encoder, decoder, rewards", "the embedded world's (under 0.1 GiB)")
    ckpt = mp.checkpointing
    p.add(
        "activations (update)",
        f"{gib(mp.activations[True])} with gradient checkpointing, {gib(mp.activations[False])} without "
        f"(up to {graphs} graph(s) alive: {cfg.backward.strategy}/{cfg.backward.graph_mode}; configured: "
        f"{'with' if ckpt else 'without'})",
    )
    p.add("no-grad forwards (rollout / eval)", f"{gib(mp.no_grad)} transient (not during the update)")
    p.add(
        f"AdamW step temporaries ({'fused' if cfg.optim.fused else 'foreach'})",
        f"{gib(mp.step)} transient (after the backward)",
    )
    p.add("CUDA context + NCCL buffers", f"{gib(CUDA_CONTEXT)} (assumed)")
    slack = ALLOCATOR_SLACK[mp.expandable_segments]
    p.add(
        "allocator fragmentation",
        f"{gib(mp.fragmentation())} ({slack:.0%} of the allocated peak, assumed; expandable_segments "
        + ("on, the CUDA runs' default)" if mp.expandable_segments else "OFF in PYTORCH_CUDA_ALLOC_CONF)"),
    )
    p.add(
        "total per GPU",
        f"{gib(mp.total())} ({gib(mp.total(not ckpt))} {'without' if ckpt else 'with'} checkpointing)",
    )
    for size in GPU_SIZES_GB:
        verdict = "fits" if mp.fits(size) else "does NOT fit"
        p.add(f"{size} GB GPU ({size * 1e9 / GIB:.1f} GiB)", f"{verdict} ({gib(mp.total())} needed)")
    pick = per_knot_pick(cfg, world_size, mp, model)
    if pick:
        p.add("graph mode picked", pick)
    p.add(
        "host memory per rank",
        f"rank 0 ~{gib(mp.host['rank 0'])} (loaded transformer once + largest other model + runtime), "
        f"other ranks ~{gib(mp.host['other ranks'])}; {_per_node(mp, world_size, ranks_per_node, gib)}; "
        "checkpoints: shards only"
        + (
            f", written asynchronously from a {gib(mp.checkpoint_copy)} CPU copy per rank (included; "
            "log.async_checkpoint=false: none)"
            if mp.checkpoint_copy
            else ""
        ),
    )
    if world_size > 1:
        gathered = all_gather_bytes(cfg, model, all_gathers, world_size)
        base = gathered["base"]
        p.add(
            "all-gathered per rank and iteration",
            f"{gib(gathered['total'])} unsharded ({gathered['rounds']} gathers of every unit: rollout + update"
            + (
                f"; {gib(base)} of it the frozen base, saved by model.shard_frozen_base=false)"
                if base
                else ")"
            ),
        )
    export = n_all * 2 if model_cfg.lora_rank == 0 and train.precision == "bf16" else n_train * 4
    p.add("export (rank 0 host, once)", gib(export))
    add_disk_section(p, cfg, model)


def per_knot_pick(cfg: Config, world_size: int, mp: MemoryPlan, model) -> str | None:
    """Where the configured stacked graph mode (``batched`` / ``joint``: the knots' graphs alive together) does
    not fit a GPU size and the per-knot backward (``backward.graph_mode: sequential``: each knot's forward and
    backward with its aggregated signal, one graph alive, the exact loop's activations, the same passes) does:
    the line saying so (None when the mode is already per-knot, the strategy exact, or nothing changes)."""
    backward = cfg.backward
    if backward.strategy == "exact" or backward.graph_mode == "sequential":
        return None
    per_knot = dataclasses.replace(cfg, backward=dataclasses.replace(backward, graph_mode="sequential"))
    seq = memory_plan(per_knot, world_size, graphs=1, held_grad=False, model=model)
    sizes = [size for size in GPU_SIZES_GB if not mp.fits(size) and seq.fits(size)]
    if not sizes:
        return None
    on = " / ".join(f"{size} GB" for size in sizes)
    return (
        f"sequential (per-knot backward) on {on}: {backward.graph_mode} needs {mp.total() / GIB:.1f} GiB, "
        f"sequential {seq.total() / GIB:.1f} GiB (one knot graph alive, the exact loop's activations, the same "
        "passes and gradient); set backward.graph_mode=sequential"
    )


def _per_node(mp, world_size: int, ranks_per_node: int | None, gib) -> str:
    """The host per node: rank 0's node, and each other node when the ranks span several."""
    n = min(world_size, ranks_per_node or world_size)
    nodes = -(-world_size // n)
    node = mp.node_host(n)
    if nodes == 1:
        return f"node ~{gib(node['node 0'])}"
    return (
        f"{nodes} nodes of {n} ranks: node 0 ~{gib(node['node 0'])}, each other ~{gib(node['other nodes'])}"
    )


def add_disk_section(p: Report, cfg: Config, model) -> None:
    """One checkpoint, the two while one is written, the embedding cache."""
    disk, data = disk_plan(cfg, model), cfg.data
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    p.section("disk (GiB; the run directory and data.embedding_cache)")
    p.add(
        "checkpoint",
        f"{gib(disk['checkpoint'])} (trained weights, AdamW moments, EMA; frozen base not saved)",
    )
    p.add(
        "while a checkpoint is written",
        f"{gib(2 * disk['checkpoint'])} (checkpoint.tmp beside the previous checkpoint until the swap)",
    )
    if cfg.model.source == "pretrained":
        p.add(
            "embedding cache",
            f"{gib(disk['embedding cache'])} in {data.embedding_cache}"
            if data.embedding_cache
            else "none (data.embedding_cache unset)",
        )
