"""``python -m jagg.train --dry-run``: what a config will do, computed without weights or downloads.

The transformer is built from its config on the meta device (no memory, no weights): the local
``model.path/transformer/config.json`` when present, otherwise the published FLUX.1-dev / Qwen-Image
architecture (``KNOWN_CONFIGS``). LoRA is applied on the meta model to count adapter parameters. The plan lists
the trained steps per sample, their groups and strategies (``jagg.engine.routing.plan_groups``), the transformer
forward / backward passes per sample for the exact baseline and the configured strategy, and a per-rank memory
plan under FSDP2 full sharding (``memory_plan``) that says per GPU size (80 GB, 141 GB) whether the run fits.

Memory plan, per rank (estimates, GiB = 2^30 bytes; GPU sizes in decimal GB as sold):
    transformer   sharded weights (trained fp32 master, frozen LoRA base in the compute dtype; in full on every
                  rank with ``model.shard_frozen_base: false``, when only the adapters are gathered), gradients,
                  AdamW moments, EMA, two unsharded blocks in
                  flight, one block's unsharded gradient (+ its fp32 reduce-scatter copy), the gradients the
                  ``joint`` endpoint mode and true CFG hold, the KL reference copy
    resident      text encoders (T5-XXL + CLIP-L for Flux, Qwen2.5-VL-7B for Qwen-Image; freed by
                  ``data.precompute_embeddings``), the VAE, every train / eval reward model (HPSv2.1 and PickScore
                  ViT-H-14, CLIPScore ViT-L/14; fp32 unless ``reward.kwargs.<name>.dtype``). Parameter counts come from the published architectures built on
                  the meta device (``AUX_MODELS``; the published counts if a library cannot)
    activations   the update's: ``graphs alive`` (``trajectory_cost``) x batch x tokens x hidden x layers, block
                  inputs only with gradient checkpointing (+ one block recomputed: 2B rows in the batched
                  endpoint mode), ~34 bytes per token and
                  hidden unit per layer without (Korthikanti et al. 2022, SDPA attention); true CFG doubles
                  them. The no-grad forwards of rollout / evaluation are transient and not simultaneous
    transients    not at the same time, so the largest counts: the update's activations, a no-grad forward,
                  the multi-tensor AdamW step's temporaries (~1 copy of the trained shards; none with
                  ``optim.fused``)
    reserve       the CUDA context and NCCL buffers (1.5 GiB) and the allocator's fragmentation (2% of the allocated
                  peak with expandable_segments, which CUDA runs set by default, 10% without); both assumed
    host          rank 0 holds the loaded transformer once (memory-mapped safetensors); every rank stages its
                  largest other model on the host while loading (the text encoders too when embeddings are
                  precomputed: loaded, used, freed); the in-memory prompt embeddings (the encoders return CPU
                  tensors); checkpoints move shards only; export gathers
                  the exported weights on rank 0 once
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from jagg.config import Config
from jagg.loop.node import expandable_segments

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
    model_cfg = cfg.model
    with torch.device("meta"):
        model = cls.from_config(config)
        if model_cfg.lora_rank > 0:
            apply_lora(
                model,
                model_cfg.lora_rank,
                model_cfg.lora_alpha,
                model_cfg.lora_targets or DEFAULT_TARGETS[model_cfg.backbone],
            )
    return model, source


def trained_steps_per_sample(cfg: Config) -> int:
    """T: how many steps of one trajectory are trained (drawn once with a fixed generator)."""
    from jagg.engine.algorithms import ALGORITHMS

    alg = ALGORITHMS[cfg.algorithm.name](cfg.algorithm, cfg.backward)
    gen = torch.Generator().manual_seed(0)
    kinds = alg.step_kinds(cfg.sampling.num_steps, gen)
    return int(alg.trained_steps(kinds, 1, gen).shape[1])


def build_plan(cfg: Config, world_size: int = 1) -> Plan:
    """The dry-run report for ``cfg`` on ``world_size`` ranks (see the module docstring)."""
    from jagg.engine.routing import Routing, trajectory_cost
    from jagg.engine.strategies import ENDPOINT_MODES

    model, sampling, algorithm, backward, train = (
        cfg.model,
        cfg.sampling,
        cfg.algorithm,
        cfg.backward,
        cfg.train,
    )
    p = Plan()
    n_global = train.prompts_per_iter * train.images_per_prompt
    p.section("run")
    p.add(
        "backbone / source", f"{model.backbone} / {model.source}" + (f" ({model.path})" if model.path else "")
    )
    p.add(
        "algorithm / SDE",
        f"{algorithm.name} / {algorithm.sde_kind} noise {algorithm.noise_level}, clip eps {algorithm.clip_range}",
    )
    res = sampling.latent_size * VAE_SCALE if model.source == "pretrained" else sampling.latent_size
    p.add(
        "image / latent",
        f"{res} px / (16, {sampling.latent_size}, {sampling.latent_size}), {(sampling.latent_size // 2) ** 2} tokens",
    )
    p.add("schedule", f"{sampling.num_steps} steps ({sampling.schedule}), eval {sampling.eval_num_steps}")
    p.add("world size", world_size)
    p.add(
        "samples per iteration",
        f"{n_global} = {train.prompts_per_iter} prompts x {train.images_per_prompt} images; {n_global // world_size} "
        f"per rank in micro-batches of {train.train_batch_size}, step every {train.grad_accum}",
    )
    p.add("precision / grad checkpointing", f"{train.precision} / {model.gradient_checkpointing}")
    p.add(
        "LoRA",
        f"rank {model.lora_rank}, alpha {model.lora_alpha}" if model.lora_rank else "none (full fine-tuning)",
    )
    rewards = ", ".join(
        f"{k} x {v}" + (f" {cfg.reward.kwargs[k]}" if k in cfg.reward.kwargs else "")
        for k, v in cfg.reward.weights.items()
    )
    p.add("train reward / eval", f"{rewards} / {', '.join(cfg.reward.eval)}")

    T = trained_steps_per_sample(cfg)
    auto = (
        backward.jagg_frac is None
    )  # routed at run time by measured cosines: planned as if every group qualifies
    routing = backward.planned_setting().routing  # group_size=auto: planned with the largest candidate
    W = routing.group_size
    groups = routing.plans(T)
    p.section(
        f"update (backward.strategy={backward.strategy}, W={W}"
        + (f" of auto {backward.candidate_group_sizes}" if backward.group_size is None else "")
        + f", jagg_frac={'auto' if auto else backward.jagg_frac}, "
        f"endpoints={backward.endpoints}, reuse_rollout={backward.reuse_rollout}, "
        f"endpoint_signals={backward.endpoint_signals})"
    )
    p.add("trained steps per sample", f"{T} of {sampling.num_steps}")
    for g, plan in enumerate(groups):
        p.add(
            f"group {g}",
            f"steps {list(plan.steps)} -> {plan.strategy}" + (" (if its cosine qualifies)" * auto),
        )
    if auto:
        p.add(
            "routing",
            f"auto: cos(JAGG, exact) per group measured at iteration 0 and every {backward.calibrate_every}; "
            f"JAGG where >= {backward.min_cosine}; the costs below assume every group qualifies",
        )
    n_micro = max(1, train.prompts_per_iter * train.images_per_prompt // world_size // train.train_batch_size)
    reused = min(n_micro, train.grad_accum) if backward.reuse_rollout else 0
    p.add(
        "stored rollout outputs used",
        f"{reused} of {n_micro} micro-batches per iteration (before the 1st step)",
    )
    cfg_mult = 2 if model.backbone == "qwenimage" and model.true_cfg_scale > 1 else 1
    exact = trajectory_cost(Routing(strategy="exact", group_size=W).plans(T))
    p.section(
        "cost per sample by endpoint mode (passes of one micro-batch; FSDP2 collectives per sharded unit;"
        + (" x2 transformer calls with true CFG;" if cfg_mult > 1 else "")
        + " * = configured)"
    )
    p.lines.append(
        f"    {'mode':<26}{'forwards (grad)':>16}{'bwd passes':>11}{'bwd calls':>10}"
        f"{'all-gathers':>12}{'reduce-scat.':>13}{'graphs alive':>13}"
    )
    # every mode's cost of the configured strategy, with and without stored outputs (exact has no modes)
    costs = {
        (mode, reuse): trajectory_cost(
            groups, endpoints=mode, reuse_outputs=reuse, endpoint_signals=backward.endpoint_signals
        )
        for mode in ENDPOINT_MODES
        for reuse in (False, True)
    }
    rows = [("exact", exact, backward.strategy == "exact")]
    if backward.strategy != "exact":
        rows += [
            (
                f"{backward.strategy}/{mode}" + ("+stored" if reuse else ""),
                c,
                (mode, reuse) == (backward.endpoints, reused > 0),
            )
            for (mode, reuse), c in costs.items()
        ]
    for name, c, mark in rows:
        p.lines.append(
            f"  {'*' if mark else ' '} {name:<26}{f'{c.forward_passes} ({c.forward_passes_with_grad})':>16}"
            f"{c.backward_passes:>11}{c.backward_calls:>10}{c.all_gathers:>12}{c.reduce_scatters:>13}"
            f"{c.graphs_alive:>13}"
        )
    ours = costs[(backward.endpoints, reused > 0)]
    p.add("backward passes saved", f"{1 - ours.backward_passes / exact.backward_passes:.0%}")
    p.add(
        "update time saved (pass counting, bwd = 2 fwd)",
        f"{1 - costs[(backward.endpoints, True)].time() / exact.time():.0%} with stored outputs, "
        f"{1 - costs[(backward.endpoints, False)].time() / exact.time():.0%} without",
    )
    p.add("rollout forwards per sample", sampling.num_steps * cfg_mult)
    _memory(
        p,
        cfg,
        world_size,
        graphs=ours.graphs_alive,
        held_grad=backward.strategy != "exact" and backward.endpoints == "joint",
        all_gathers=ours.all_gathers,
    )
    return p


# --------------------------------------------------------------------------- memory
# Models a paper-scale run keeps besides the transformer: (what, how to build it on the meta device, published
# parameter count). Architectures are the hub repos' config.json values (open_clip's bundled ViT-H-14 config for
# HPSv2.1); the published count is the fallback when a library cannot build one on the meta device.
_T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
_CLIP_L_TEXT = dict(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12
)
_CLIP_L_VISION = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, patch_size=14
)
_CLIP_H_TEXT = dict(
    vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16
)
_CLIP_H_VISION = dict(
    hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16, patch_size=14
)
_QWEN25_VL_7B = dict(
    text_config=dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    vision_config=dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584
    ),
    tie_word_embeddings=False,
)
_FLUX_VAE = dict(
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    latent_channels=16,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


def _build_aux(name: str):
    import transformers as tf

    if name == "t5_xxl":
        return tf.T5EncoderModel(tf.T5Config(feed_forward_proj="gated-gelu", **_T5_XXL))
    if name == "clip_l_text":
        return tf.CLIPTextModel(tf.CLIPTextConfig(max_position_embeddings=77, **_CLIP_L_TEXT))
    if name == "qwen25_vl_7b":
        return tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(**_QWEN25_VL_7B))
    if name == "hpsv2":
        import open_clip

        return open_clip.create_model("ViT-H-14", pretrained=None, device="meta")
    if name in ("pickscore", "clipscore"):
        text, vision, proj = (
            (_CLIP_H_TEXT, _CLIP_H_VISION, 1024)
            if name == "pickscore"
            else (_CLIP_L_TEXT, _CLIP_L_VISION, 768)
        )
        return tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=proj))
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage

    return AutoencoderKL(**_FLUX_VAE) if name == "flux_vae" else AutoencoderKLQwenImage()  # its defaults


AUX_MODELS = {  # name -> (description, published parameter count)
    "t5_xxl": ("T5-XXL encoder (google/t5-v1_1-xxl)", 4.762e9),
    "clip_l_text": ("CLIP-L text (openai/clip-vit-large-patch14)", 123.1e6),
    "qwen25_vl_7b": ("Qwen2.5-VL-7B (with its vision tower)", 8.292e9),
    "flux_vae": ("FLUX.1-dev VAE", 83.8e6),
    "qwenimage_vae": ("Qwen-Image VAE", 126.9e6),
    "hpsv2": ("HPSv2.1: open_clip ViT-H-14", 986.1e6),
    "pickscore": ("PickScore: CLIP ViT-H-14", 986.1e6),
    "clipscore": ("CLIPScore: CLIP ViT-L/14", 427.6e6),
}
TEXT_ENCODERS = {"flux": ("t5_xxl", "clip_l_text"), "qwenimage": ("qwen25_vl_7b",)}
GPU_SIZES_GB = (80, 141)  # H100 / A100 80 GB, H200 141 GB (decimal GB, as sold)
# Assumptions, not measured (no GPU here): the CUDA context with lazy module loading, cuBLAS workspaces and NCCL's
# communicator buffers on an 8-GPU node; and what the caching allocator reserves beyond what is allocated, as a
# fraction of the allocated peak, with expandable_segments (the default of CUDA runs: jagg.loop.node) or without.
CUDA_CONTEXT = 1.5 * GIB
ALLOCATOR_SLACK = {True: 0.02, False: 0.10}
HOST_BASELINE = 4 * GIB  # one rank's Python + torch + CUDA libraries on the host (measured ~0.8 GiB on CPU)
ACT_BYTES_PER_TOKEN_HIDDEN = (
    34  # one transformer layer's saved activations, bf16, SDPA attention (Korthikanti+22)
)
PROMPT_LRU = 512  # CachedTextEncoder's default in-memory cache (jagg.scale.pipelines)
HPDV2_TRAIN_PROMPTS = 100_000  # order of magnitude of HPDv2's train prompts, when data.*_limit is unset
_aux_cache: dict[str, int] = {}


def aux_params(name: str) -> int:
    """Parameters of ``AUX_MODELS[name]``, counted on the meta device (published count if that fails)."""
    if name not in _aux_cache:
        try:
            with torch.device("meta"):
                model = _build_aux(name)
            _aux_cache[name] = sum(p.numel() for p in model.parameters())
        except Exception:  # a library too old / missing: the published number
            _aux_cache[name] = int(AUX_MODELS[name][1])
    return _aux_cache[name]


def _reward_dtype_bytes(kwargs: dict) -> int:
    d = str(kwargs.get("dtype", "fp32")).removeprefix("torch.")
    return 2 if d in ("bf16", "bfloat16", "fp16", "float16", "half") else 4


@dataclass
class MemoryPlan:
    """Per-rank bytes of one configuration (``memory_plan``); GPU lines are on every rank unless noted."""

    gpu: dict[str, float]  # resident items (checkpointing as configured)
    activations: dict[bool, float]  # gradient checkpointing on / off -> bytes of the update's activations
    no_grad: float  # transient peak of a rollout / evaluation forward (not at the same time as the update)
    host: dict[str, float]  # "rank 0" / "other ranks" peak host bytes
    checkpointing: bool
    # the AdamW step's temporaries: after the backward, not at the same time as its activations
    step: float = 0.0
    expandable_segments: bool = True  # the allocator setting the run will have (ALLOCATOR_SLACK)

    def transient(self, checkpointing: bool | None = None) -> float:
        """The largest of the phases that never overlap: update activations, a no-grad forward, the step."""
        ckpt = self.checkpointing if checkpointing is None else checkpointing
        return max(self.activations[ckpt], self.no_grad, self.step)

    def allocated(self, checkpointing: bool | None = None) -> float:
        """The allocated peak: every resident item plus the largest transient."""
        return sum(self.gpu.values()) + self.transient(checkpointing)

    def fragmentation(self, checkpointing: bool | None = None) -> float:
        """What the allocator reserves beyond the allocated peak (``ALLOCATOR_SLACK``, assumed)."""
        return ALLOCATOR_SLACK[self.expandable_segments] * self.allocated(checkpointing)

    def reserve(self, checkpointing: bool | None = None) -> float:
        """Beyond the allocated peak: the CUDA context (+ NCCL) and the allocator's fragmentation."""
        return CUDA_CONTEXT + self.fragmentation(checkpointing)

    def total(self, checkpointing: bool | None = None) -> float:
        return self.allocated(checkpointing) + self.reserve(checkpointing)

    def fits(self, gpu_gb: int, checkpointing: bool | None = None) -> bool:
        return self.total(checkpointing) <= gpu_gb * 1e9


def memory_plan(cfg: Config, world_size: int, graphs: int, held_grad: bool, model=None) -> MemoryPlan:
    """Bytes per rank of every resident model, gradients, optimizer state, activations, and host memory.

    ``graphs``: autograd graphs alive at once in the update (``trajectory_cost(...).graphs_alive``);
    ``held_grad``: the ``joint`` endpoint mode's unsharded gradients held during its backward (true CFG holds
    the same: counted once).
    """
    model = model if model is not None else meta_transformer(cfg)[0]
    model_cfg, train, sampling, data = cfg.model, cfg.train, cfg.sampling, cfg.data
    n_all = sum(x.numel() for x in model.parameters())
    n_train = sum(x.numel() for x in model.parameters() if x.requires_grad)
    blocks = [*getattr(model, "transformer_blocks", []), *getattr(model, "single_transformer_blocks", [])]
    n_block = max((sum(x.numel() for x in blk.parameters()) for blk in blocks), default=0)
    master = (
        8 if train.precision == "fp64" else 4
    )  # trained parameters (bf16 = autocast over fp32 master weights)
    compute = 2 if train.precision == "bf16" else master  # activations; frozen parameters stay in this dtype
    r = world_size
    replicated = not model_cfg.shard_frozen_base  # the frozen LoRA base in full on every rank
    gpu = {
        "transformer weights (sharded)": (n_train * master + (0 if replicated else n_all - n_train) * compute)
        / r,
        "gradients (sharded)": n_train * master / r,
        "AdamW moments (sharded)": 2 * n_train * 4 / r,
    }
    if cfg.optim.ema_decay > 0:
        gpu["EMA (sharded)"] = n_train * master / r
    # torch's multi-tensor AdamW: ~1 copy of the trained shards, transient (simulated: results/plan_check.md);
    # the fused kernel (optim.fused) has none
    step = 0.0 if cfg.optim.fused else n_train * 4 / r
    n_block_train = max(
        (sum(x.numel() for x in blk.parameters() if x.requires_grad) for blk in blocks), default=0
    )
    if replicated:  # resident; only the adapters are all-gathered
        gpu["frozen base (replicated)"] = (n_all - n_train) * compute
    # current + prefetched block
    gpu["unsharded blocks in flight"] = 2 * (n_block_train if replicated else n_block) * compute
    gpu["unsharded gradients of one block"] = n_block_train * (compute + 4)  # + fp32 reduce-scatter copy
    cfg_mult = 2 if model_cfg.backbone == "qwenimage" and model_cfg.true_cfg_scale > 1 else 1
    held = [why for why, on in (("joint", held_grad), ("true CFG", cfg_mult > 1)) if on]
    if held:
        # joint endpoints under FSDP2: the later graph's gradient for a unit waits unsharded until the earlier
        # graph reaches that unit; true CFG: the backward of one of the two transformer calls per velocity runs
        # through every block before the other call's reaches it, and each block's unsharded gradient waits
        # for that. Summed over the backward, up to every trainable parameter (one buffer per parameter:
        # counted once when both apply).
        gpu[f"unsharded gradients held ({' / '.join(held)})"] = n_train * compute
    if cfg.algorithm.kl_beta > 0:
        gpu["KL reference (unsharded copy)"] = n_all * compute
    pretrained = model_cfg.source == "pretrained"
    aux: dict[str, int] = {}
    if pretrained:
        if not data.precompute_embeddings:
            aux.update({k: aux_params(k) * compute for k in TEXT_ENCODERS[model_cfg.backbone]})
        vae = "flux_vae" if model_cfg.backbone == "flux" else "qwenimage_vae"
        aux[vae] = aux_params(vae) * compute
        for name in dict.fromkeys([*cfg.reward.weights, *cfg.reward.eval]):  # train and eval, all resident
            if name in AUX_MODELS:
                aux[name] = aux_params(name) * _reward_dtype_bytes(cfg.reward.kwargs.get(name, {}))
    gpu.update({f"{AUX_MODELS[k][0]}": v for k, v in aux.items()})
    # CachedTextEncoder's rows are host memory on every rank (the encoders return CPU tensors; the trainer moves
    # one micro-batch's conditioning to the GPU): the LRU without a cache dir, every prompt when precomputed
    host_prompts = 0.0
    if pretrained and not data.embedding_cache:
        prompts = PROMPT_LRU
        if data.precompute_embeddings:  # every train + eval prompt stays in memory
            prompts = (data.train_limit or HPDV2_TRAIN_PROMPTS) + (data.eval_limit or HPDV2_TRAIN_PROMPTS)
        host_prompts = prompts * embedding_bytes(cfg, model)
    # activations of the update: per graph, B samples x tokens x hidden x layers
    hidden = model.config.num_attention_heads * model.config.attention_head_dim
    txt = (
        model_cfg.max_sequence_length if model_cfg.backbone == "flux" else 64
    )  # Flux pads T5 to the max; Qwen: typical prompt
    tokens = (sampling.latent_size // 2) ** 2 + txt
    per_layer = train.train_batch_size * cfg_mult * tokens * hidden  # elements
    # the batched endpoint mode runs one forward of 2B rows, so the block recomputed in its backward has 2B rows
    backward = cfg.backward
    recompute_rows = 2 if backward.strategy != "exact" and backward.endpoints == "batched" else 1
    activations = {
        # checkpointing: block inputs of every layer per graph + one block recomputed at a time
        True: graphs * per_layer * len(blocks) * compute
        + recompute_rows * per_layer * ACT_BYTES_PER_TOKEN_HIDDEN,
        False: graphs * per_layer * len(blocks) * ACT_BYTES_PER_TOKEN_HIDDEN,
    }
    # no-grad forwards (rollout at train_batch_size, evaluation in chunks of up to 32 per rank): one block's
    # intermediates at a time, ~20 x hidden per token (qkv, attention output, 4x MLP) in the compute dtype
    log = cfg.log
    eval_batch = min(32, -(-log.eval_prompts * log.eval_images_per_prompt // r)) if log.eval_every else 0
    no_grad = max(train.train_batch_size, eval_batch) * cfg_mult * tokens * hidden * 20 * compute
    # host: rank 0 holds the loaded transformer once (memory-mapped safetensors, load dtype), every rank the
    # largest other model while it loads it (weights are read to the host, then moved to the GPU).
    load_bytes = n_all * (2 if train.precision == "bf16" else 4) if pretrained else 0
    staged = dict(aux)
    if (
        pretrained
    ):  # precomputed embeddings: every rank still loads (stages) its text encoders once, then frees
        staged.update({k: aux_params(k) * compute for k in TEXT_ENCODERS[model_cfg.backbone]})
    staging = max(
        [aux_params(k) * 4 * 2 if k in ("hpsv2",) else v for k, v in staged.items()], default=0
    )  # HPSv2.1: a random-init fp32 model plus the fp32 checkpoint it loads
    host = {
        "rank 0": HOST_BASELINE + load_bytes + staging + host_prompts,
        "other ranks": HOST_BASELINE + staging + host_prompts,
    }
    return MemoryPlan(
        gpu=gpu,
        activations=activations,
        no_grad=no_grad,
        host=host,
        checkpointing=model_cfg.gradient_checkpointing,
        step=step,
        expandable_segments=expandable_segments(),
    )


def all_gather_bytes(cfg: Config, model, all_gathers: int, world_size: int) -> dict[str, float]:
    """Unsharded bytes FSDP2 all-gathers per rank and iteration (each rank receives (r-1)/r of them).

    ``all_gathers``: all-gathers per sharded unit of one micro-batch's update (``trajectory_cost``); the
    rollout of a micro-batch gathers every unit once per transformer call. ``base``: the frozen LoRA base's
    share, which ``model.shard_frozen_base: false`` saves (the adapters alone are gathered then).
    """
    model_cfg, train, sampling = cfg.model, cfg.train, cfg.sampling
    compute = 2 if train.precision == "bf16" else (8 if train.precision == "fp64" else 4)
    n_all = sum(x.numel() for x in model.parameters())
    n_train = sum(x.numel() for x in model.parameters() if x.requires_grad)
    cfg_mult = 2 if model_cfg.backbone == "qwenimage" and model_cfg.true_cfg_scale > 1 else 1
    n_micro = max(1, train.prompts_per_iter * train.images_per_prompt // world_size // train.train_batch_size)
    rounds = n_micro * (all_gathers + sampling.num_steps * cfg_mult)
    base = (n_all - n_train) * compute * rounds
    total = n_all * compute * rounds
    if not model_cfg.shard_frozen_base:
        total -= base
    return {"total": total, "base": base if model_cfg.shard_frozen_base else 0.0, "rounds": rounds}


def _memory(
    p: Plan, cfg: Config, world_size: int, graphs: int, held_grad: bool, all_gathers: int = 0
) -> None:
    model, source = meta_transformer(cfg)
    mp = memory_plan(cfg, world_size, graphs, held_grad, model)
    model_cfg, train, data = cfg.model, cfg.train, cfg.data
    n_all = sum(x.numel() for x in model.parameters())
    n_train = sum(x.numel() for x in model.parameters() if x.requires_grad)
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
        f"(up to {graphs} graph(s) alive: {cfg.backward.strategy}/{cfg.backward.endpoints}; configured: "
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
    p.add(
        "host memory per rank",
        f"rank 0 ~{gib(mp.host['rank 0'])} (loaded transformer once + largest other model + runtime), "
        f"other ranks ~{gib(mp.host['other ranks'])}; node ~"
        f"{gib(mp.host['rank 0'] + (world_size - 1) * mp.host['other ranks'])}; checkpoints: shards only",
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
    disk = disk_plan(cfg, model)
    p.section("disk (GiB; the run directory and data.embedding_cache)")
    p.add(
        "checkpoint",
        f"{gib(disk['checkpoint'])} (trained weights, AdamW moments, EMA; frozen base not saved)",
    )
    p.add(
        "while a checkpoint is written",
        f"{gib(2 * disk['checkpoint'])} (checkpoint.tmp beside the previous checkpoint until the swap)",
    )
    if model_cfg.source == "pretrained":
        p.add(
            "embedding cache",
            f"{gib(disk['embedding cache'])} in {data.embedding_cache}"
            if data.embedding_cache
            else "none (data.embedding_cache unset)",
        )


def embedding_bytes(cfg: Config, model) -> int:
    """Bytes of one prompt's cached text conditioning (bf16 rows; the mask and pooled vector included)."""
    model_cfg = cfg.model
    width = model.config.joint_attention_dim
    if model_cfg.backbone == "flux":
        return model_cfg.max_sequence_length * (width * 2 + 8) + 768 * 2
    rows = 64 * (
        2 if model_cfg.true_cfg_scale > 1 else 1
    )  # a typical prompt (+ the negative one with true CFG)
    return rows * (width * 2 + 8)


def disk_plan(cfg: Config, model) -> dict[str, float]:
    """Bytes on disk: one checkpoint (``jagg.loop.checkpoint``: trained parameters in their master dtype, two
    fp32 AdamW moments, the EMA copy; ``ignore_frozen_params``) and the embedding cache (one file per train and
    eval prompt, ``embedding_bytes`` each) when ``data.embedding_cache`` is set."""
    data = cfg.data
    n_train = sum(x.numel() for x in model.parameters() if x.requires_grad)
    master = 8 if cfg.train.precision == "fp64" else 4
    ema = n_train * master if cfg.optim.ema_decay > 0 else 0
    prompts = (data.train_limit or HPDV2_TRAIN_PROMPTS) + (data.eval_limit or HPDV2_TRAIN_PROMPTS)
    cache = prompts * embedding_bytes(cfg, model) if data.embedding_cache else 0
    return {"checkpoint": float(n_train * (master + 8) + ema), "embedding cache": float(cache)}
