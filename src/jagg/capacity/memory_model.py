"""The dry run's memory model: bytes per rank of a config on a node, computed without weights or a GPU.

The transformer a config describes is built on the meta device (``meta_transformer``: the local
``model.path/transformer/config.json`` when present, otherwise the published architecture,
``jagg.scale.architectures.KNOWN_CONFIGS``; LoRA applied, to count adapter parameters); the other models are
counted from their published architectures (``AUX_MODELS``). ``memory_plan`` returns the terms below,
``all_gather_bytes`` what FSDP2 gathers per iteration, ``disk_plan`` the disk. ``make plan-check`` compares the
transformer terms with a simulated 8-GPU node (``results/plan_check.md``).

Memory plan, per rank (estimates, GiB = 2^30 bytes; GPU sizes in decimal GB as sold):
    transformer   sharded weights (trained fp32 master, frozen LoRA base in the compute dtype; in full on every
                  rank with ``model.shard_frozen_base: false``, when only the adapters are gathered), gradients,
                  AdamW moments, EMA, floating buffers (replicated, fp32: SD3's positional table), two unsharded
                  blocks in flight, one block's unsharded gradient (+ its fp32 reduce-scatter copy), the
                  gradients the ``joint`` graph mode and two-call true CFG (Qwen-Image) hold, the KL
                  reference copy
    resident      text encoders (T5-XXL + CLIP-L for Flux, Qwen2.5-VL-7B for Qwen-Image; freed by
                  ``data.precompute_embeddings``), the VAE, every train / eval reward model (HPSv2.1 and PickScore
                  ViT-H-14, CLIPScore ViT-L/14, ImageReward, HPSv3's Qwen2-VL-7B; ``reward.kwargs.<name>.dtype``, else
                  the reward's default: bf16 for HPSv3, fp32 for the others). Parameter counts come from the published architectures built on
                  the meta device (``AUX_MODELS``; the published counts if a library cannot)
    activations   the update's: ``graphs alive`` (``BackwardSetting.cost``) x batch x tokens x hidden x layers, block
                  inputs only with gradient checkpointing (+ one block recomputed: 2B rows in the batched
                  graph mode), ~34 bytes per token and
                  hidden unit per layer without (Korthikanti et al. 2022, SDPA attention); true CFG doubles
                  them. The no-grad forwards of rollout / evaluation are transient and not simultaneous
    transients    not at the same time, so the largest counts: the update's activations, a no-grad forward,
                  the multi-tensor AdamW step's temporaries (~1 copy of the trained shards; none with
                  ``optim.fused``)
    reserve       the CUDA context and NCCL buffers (1.5 GiB) and the allocator's fragmentation (2% of the allocated
                  peak with expandable_segments, which CUDA runs set by default, 10% without); both assumed
    host          rank 0 holds the loaded transformer once (memory-mapped safetensors); every rank stages its
                  largest other model on the host while loading (the text encoders too when embeddings are
                  precomputed: loaded, used, freed; HPSv3 only its largest tensor: ``STREAMED_LOAD``); the in-memory prompt embeddings (the encoders return CPU
                  tensors); checkpoints move shards only, but an asynchronous save (``log.async_checkpoint``, on
                  CUDA by default) holds a CPU copy of the rank's share while it is written; export gathers
                  the exported weights on rank 0 once
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from jagg.config import Config
from jagg.engine.strategies import GRAPH_MODES
from jagg.errors import ConfigError
from jagg.ops.node import expandable_segments
from jagg.scale.architectures import (
    AUX_MODELS,
    CFG_NO_GRAD_CALL,
    CFG_TWO_CALLS,
    KNOWN_CONFIGS,
    TEXT_ENCODERS,
    TRUE_CFG,
    aux_largest_tensor,
    aux_params,
    known_wan,
)
from jagg.scale.distributed import transformer_blocks

GIB = 2**30
GPU_SIZES_GB = (80, 141)  # H100 / A100 80 GB, H200 141 GB (decimal GB, as sold)
# Assumptions, not measured (no GPU here): the CUDA context with lazy module loading, cuBLAS workspaces and NCCL's
# communicator buffers on an 8-GPU node; and what the caching allocator reserves beyond what is allocated, as a
# fraction of the allocated peak, with expandable_segments (the default of CUDA runs: jagg.ops.node) or without.
CUDA_CONTEXT = 1.5 * GIB
ALLOCATOR_SLACK = {True: 0.02, False: 0.10}
HOST_BASELINE = 4 * GIB  # one rank's Python + torch + CUDA libraries on the host (measured ~0.8 GiB on CPU)
# Bytes per token x hidden of one transformer block in bf16: (what its forward saves for its backward, the
# backward's own temporaries at its peak: the gradients of those activations while they are alive).
#   default: Korthikanti+22's GPT block with SDPA attention (34), no temporaries: it stays above every image
#     model's simulated activations (results/plan_check.md), a conservative figure;
#   wan: measured on the simulated node (Wan2.1-1.3B at 480x480x53, results/plan_check_video.md): 53 saved (ACT
#     less every block's checkpointed input; the saved-tensor meter on one real WanTransformerBlock gives 50 to
#     52: its FFN is 5.83x the hidden width against GPT's 4x, its LayerNorms run in fp32, and it adds
#     cross-attention and q/k RMSNorm) and 29 of temporaries (TEMP at the same peak). GPT's 34 and no
#     temporaries under-counted Wan's update activations by a third (9.35 against 14.72 GiB).
BLOCK_BYTES_PER_TOKEN_HIDDEN = {"default": (34, 0), "wan": (53, 29)}
# Wan2.2-TI2V embeds one timestep per token (``expand_timesteps``), so each block's six modulations are per token
# too: diffusers' WanTransformerBlock adds them to its table in fp32, (B, S, 6, D), 24 bytes per token x hidden,
# kept by the gates that multiply views of it, and saves the fp32 (1 + scale) of its two modulated norms, 8 more.
# The saved-tensor meter on a real block reads 32.0 over the per-sample block at a quarter of the 1.3B's width
# (tests/test_wan_scale.py) and at a quarter of the TI2V-5B's.
PER_TOKEN_MODULATION_BYTES = 32
PROMPT_LRU = 512  # CachedTextEncoder's default in-memory cache (jagg.scale.pipelines)
HPDV2_TRAIN_PROMPTS = 100_000  # order of magnitude of HPDv2's train prompts, when data.*_limit is unset


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
    if cfg.model.backbone == "wan":  # which Wan model.path names (1.3B / TI2V-5B / A14B)
        return known_wan(cfg.model.path).config, f"known {cfg.model.path or 'wan'} architecture"
    return KNOWN_CONFIGS[cfg.model.backbone], f"known {cfg.model.backbone} architecture"


def expert_boundaries(cfg: Config) -> tuple[float, ...]:
    """The sigmas where the velocity switches network: Wan2.2-A14B's ``boundary_ratio`` (from a local pipeline
    folder's model_index.json, else the published pipeline ``model.path`` names), () for one network."""
    if cfg.model.backbone != "wan" or cfg.model.source != "pretrained":
        return ()
    data = local_pipeline_index(cfg)
    if data is not None:
        two = (data.get("transformer_2") or [None])[0] is not None
        return (float(data["boundary_ratio"]),) if two and data.get("boundary_ratio") else ()
    ratio = known_wan(cfg.model.path).boundary_ratio
    return () if ratio is None else (ratio,)


def local_pipeline_index(cfg: Config) -> dict | None:
    """The model_index.json of the local pipeline folder ``model.path`` names, or None (a hub id, a bare
    transformer folder): then the published pipeline it names (``known_wan``) says."""
    index = os.path.join(os.path.expanduser(cfg.model.path or ""), "model_index.json")
    if not os.path.isfile(index):
        return None
    with open(index) as fh:
        return json.load(fh)


def experts(cfg: Config) -> int:
    """Transformers the velocity is made of: 2 for Wan2.2-A14B (its high- and low-noise experts, each as large as
    the one ``meta_transformer`` builds), else 1."""
    return 1 + len(expert_boundaries(cfg))


def block_bytes(cfg: Config) -> tuple[int, int]:
    """(saved, backward temporaries) bytes per token x hidden of one block of the config's backbone."""
    table = BLOCK_BYTES_PER_TOKEN_HIDDEN
    saved, temporaries = table.get(cfg.model.backbone, table["default"])
    return saved + PER_TOKEN_MODULATION_BYTES * expand_timesteps(cfg), temporaries


def expand_timesteps(cfg: Config) -> bool:
    """Whether the Wan pipeline embeds one timestep per token (Wan2.2-TI2V-5B): a local pipeline folder's
    model_index.json, else the published pipeline ``model.path`` names."""
    if cfg.model.backbone != "wan" or cfg.model.source != "pretrained":
        return False
    data = local_pipeline_index(cfg)
    return known_wan(cfg.model.path).expand_timesteps if data is None else bool(data.get("expand_timesteps"))


def latent_cells(cfg: Config) -> int:
    """Latent cells of one sample: frames x height x width (``sampling.latent_width``: non-square)."""
    s = cfg.sampling
    return s.latent_frames * s.latent_size * (s.latent_width or s.latent_size)


def sequence_tokens(cfg: Config) -> int:
    """Tokens of the transformer's self-attention sequence: the latent's 2x2 patches (Wan: per latent frame), plus
    the text for the joint-attention models; Wan reads its text by cross-attention, outside the sequence."""
    patches = latent_cells(cfg) // 4
    return patches if cfg.model.backbone == "wan" else patches + text_tokens(cfg.model)


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


def text_tokens(model_cfg) -> int:
    """Text tokens per prompt in the transformer's sequence: Flux pads T5 to the max; SD3 the 77 CLIP tokens +
    T5 padded to the max; Qwen-Image a typical prompt (it truncates, not pads)."""
    return {
        "flux": model_cfg.max_sequence_length,
        "sd3": 77 + model_cfg.max_sequence_length,
        "wan": model_cfg.max_sequence_length,  # WanPipeline pads UMT5's output to max_sequence_length
    }.get(model_cfg.backbone, 64)


# rewards built on their device and filled one tensor at a time from a memory-mapped checkpoint
# (jagg.scale.hpsv3.load_streamed): a rank stages the largest tensor on the host, not the model; the mapped file
# is the node's page cache, shared by its ranks and reclaimable
STREAMED_LOAD = ("hpsv3",)


def _host_staging(cfg: Config, name: str, resident: float) -> float:
    """Host bytes one rank holds while loading ``name`` (``resident``: its bytes on the GPU): the whole model
    (weights read to the host, then moved), HPSv2.1 twice in fp32 (a random-init fp32 model plus the fp32
    checkpoint it loads), a streamed reward its largest tensor in its dtype."""
    if name == "hpsv2":
        return aux_params(name) * 4 * 2
    if name in STREAMED_LOAD:
        return aux_largest_tensor(name) * _reward_dtype_bytes(reward_models(cfg).get(name, {}), name)
    return resident


def reward_models(cfg: Config) -> dict[str, dict]:
    """The reward models a run holds, train and eval, each with its kwargs: a ``per_frame`` reward holds the
    image reward it wraps (``reward.kwargs.per_frame.reward``, built with its ``reward_kwargs``)."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys([*cfg.reward.weights, *cfg.reward.eval]):
        kwargs = cfg.reward.kwargs.get(name) or {}
        if name == "per_frame":
            name, kwargs = kwargs.get("reward", "jpeg"), kwargs.get("reward_kwargs") or {}
        out.setdefault(name, kwargs)
    return out


# a reward's default dtype where it is not fp32: HPSv3Reward's (jagg.scale.hpsv3.DTYPE, HPSv3's bf16)
REWARD_DEFAULT_DTYPE = {"hpsv3": "bf16"}


def _reward_dtype_bytes(kwargs: dict, name: str = "") -> int:
    d = str(kwargs.get("dtype", REWARD_DEFAULT_DTYPE.get(name, "fp32"))).removeprefix("torch.")
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
    checkpoint_copy: float = 0.0  # host bytes per rank of an asynchronous save's CPU copy (included in host)

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

    def node_host(self, ranks_per_node: int) -> dict[str, float]:
        """Host bytes of a node of ``ranks_per_node`` ranks: the first (rank 0 among them) and any other."""
        n = max(1, ranks_per_node)
        return {
            "node 0": self.host["rank 0"] + (n - 1) * self.host["other ranks"],
            "other nodes": n * self.host["other ranks"],
        }


def memory_plan(cfg: Config, world_size: int, graphs: int, held_grad: bool, model=None) -> MemoryPlan:
    """Bytes per rank of every resident model, gradients, optimizer state, activations, and host memory.

    ``graphs``: autograd graphs alive at once in the update (``BackwardSetting.cost(...).graphs_alive``);
    ``held_grad``: the ``joint`` graph mode's unsharded gradients held during its backward (true CFG holds
    the same: counted once).
    """
    model = model if model is not None else meta_transformer(cfg)[0]
    model_cfg, train, data = cfg.model, cfg.train, cfg.data
    # Wan2.2-A14B: two experts, each trained and sharded alike (its weights, gradients, optimizer state); one
    # of them runs at a time, so the per-block and activation terms are one expert's
    e = experts(cfg)
    n_all = e * sum(x.numel() for x in model.parameters())
    n_train = e * sum(x.numel() for x in model.parameters() if x.requires_grad)
    blocks = transformer_blocks(model, strict=False)
    n_block = max((sum(x.numel() for x in blk.parameters()) for blk in blocks), default=0)
    master = (
        8 if train.precision == "fp64" else 4
    )  # trained parameters (bf16 = autocast over fp32 master weights)
    compute = 2 if train.precision == "bf16" else master  # activations
    # frozen transformer parameters and the VAE: the compute dtype, or fp32 with model.base_dtype=fp32 (the
    # FSDP2 all-gathers of a sharded base stay in the compute dtype: its mixed-precision policy)
    frozen = 4 if model_cfg.base_dtype == "fp32" else compute
    r = world_size
    replicated = not model_cfg.shard_frozen_base  # the frozen LoRA base in full on every rank
    gpu = {
        "transformer weights (sharded)": (n_train * master + (0 if replicated else n_all - n_train) * frozen)
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
        gpu["frozen base (replicated)"] = (n_all - n_train) * frozen
    # FSDP2 shards parameters only; placement casts floating buffers to the master dtype (cast_parameters).
    # SD3's positional table (pos_embed_max_size^2 x hidden: 0.84 GiB for SD3.5-M) is one; Flux / Qwen-Image none
    buffers = e * sum(b.numel() for b in model.buffers() if b.is_floating_point())
    if buffers:
        gpu["transformer buffers (replicated)"] = buffers * master
    # current + prefetched block
    gpu["unsharded blocks in flight"] = 2 * (n_block_train if replicated else n_block) * compute
    gpu["unsharded gradients of one block"] = n_block_train * (compute + 4)  # + fp32 reduce-scatter copy
    cfg_mult = 2 if model_cfg.backbone in TRUE_CFG and model_cfg.true_cfg_scale > 1 else 1
    two_calls = cfg_mult > 1 and model_cfg.backbone in CFG_TWO_CALLS
    held = [why for why, on in (("joint", held_grad), ("true CFG", two_calls)) if on]
    if held:
        # joint endpoints under FSDP2: the later graph's gradient for a unit waits unsharded until the earlier
        # graph reaches that unit; true CFG: the backward of one of the two transformer calls per velocity runs
        # through every block before the other call's reaches it, and each block's unsharded gradient waits
        # for that. Summed over the backward, up to every trainable parameter (one buffer per parameter:
        # counted once when both apply).
        gpu[f"unsharded gradients held ({' / '.join(held)})"] = n_train * compute
    if cfg.algorithm.kl_beta > 0:
        gpu["KL reference (unsharded copy)"] = n_all * frozen
    pretrained = model_cfg.source == "pretrained"
    aux: dict[str, int] = {}
    if pretrained:
        if not data.precompute_embeddings:
            aux.update({k: aux_params(k) * compute for k in TEXT_ENCODERS[model_cfg.backbone]})
        vaes = {"qwenimage": "qwenimage_vae", "wan": known_wan(model_cfg.path).vae}
        vae = vaes.get(model_cfg.backbone, "flux_vae")  # SD3's VAE: Flux's layout
        aux[vae] = aux_params(vae) * frozen
        for name, kwargs in reward_models(cfg).items():  # train and eval, all resident
            if name in AUX_MODELS:
                aux[name] = aux_params(name) * _reward_dtype_bytes(kwargs, name)
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
    tokens = sequence_tokens(cfg)
    per_layer = train.train_batch_size * cfg_mult * tokens * hidden  # elements
    # a stacked graph mode runs one forward over its knots' rows (2B for a JAGG group, up to K B for knots or
    # max_rows), so the block recomputed in its backward has that many rows: the graphs alive
    backward = cfg.backward
    recompute_rows = (
        graphs if backward.strategy != "exact" and GRAPH_MODES[backward.graph_mode].stacked else 1
    )
    saved, temporaries = block_bytes(cfg)
    activations = {
        # checkpointing: block inputs of every layer per graph + one block recomputed at a time, and that
        # block's backward temporaries
        True: graphs * per_layer * len(blocks) * compute + recompute_rows * per_layer * (saved + temporaries),
        False: graphs * per_layer * len(blocks) * saved + recompute_rows * per_layer * temporaries,
    }
    # no-grad forwards (rollout at train_batch_size, evaluation in chunks of up to 32 per rank): one block's
    # intermediates at a time, ~20 x hidden per token (qkv, attention output, 4x MLP) in the compute dtype
    log = cfg.log
    eval_batch = (
        min(32, -(-log.eval_prompts * log.eval_images_per_prompt // r))
        if log.eval_every or log.eval_at
        else 0
    )
    no_grad = max(train.train_batch_size, eval_batch) * cfg_mult * tokens * hidden * 20 * compute
    # host: rank 0 holds the loaded transformer once (memory-mapped safetensors, load dtype), every rank the
    # largest other model while it loads it (weights are read to the host, then moved to the GPU).
    load_bytes = n_all * (2 if frozen == 2 else 4) if pretrained else 0  # jagg.scale.placement.weights_dtype
    staged = dict(aux)
    if (
        pretrained
    ):  # precomputed embeddings: every rank still loads (stages) its text encoders once, then frees
        staged.update({k: aux_params(k) * compute for k in TEXT_ENCODERS[model_cfg.backbone]})
    staging = max([_host_staging(cfg, k, v) for k, v in staged.items()], default=0)
    # log.async_checkpoint: a save's CPU copy of this rank's share, held while it is written; that is during
    # training, after the loading's transients, so the larger of the two counts. The plan is for a GPU node
    # unless train.device=cpu.
    device = "cpu" if train.device == "cpu" else "cuda"
    ckpt_copy = checkpoint_bytes(cfg, n_train) / r if cfg.log.writes_async(device) else 0.0
    host = {
        "rank 0": HOST_BASELINE + host_prompts + max(load_bytes + staging, ckpt_copy),
        "other ranks": HOST_BASELINE + host_prompts + max(staging, ckpt_copy),
    }
    return MemoryPlan(
        gpu=gpu,
        activations=activations,
        no_grad=no_grad,
        host=host,
        checkpointing=model_cfg.gradient_checkpointing,
        step=step,
        expandable_segments=expandable_segments(),
        checkpoint_copy=ckpt_copy,
    )


def all_gather_bytes(cfg: Config, model, all_gathers: int, world_size: int) -> dict[str, float]:
    """Unsharded bytes FSDP2 all-gathers per rank and iteration (each rank receives (r-1)/r of them).

    ``all_gathers``: all-gathers per sharded unit of one micro-batch's update (``BackwardSetting.cost``); the
    rollout of a micro-batch gathers every unit once per transformer call. ``base``: the frozen LoRA base's
    share, which ``model.shard_frozen_base: false`` saves (the adapters alone are gathered then).
    """
    model_cfg, train, sampling = cfg.model, cfg.train, cfg.sampling
    compute = 2 if train.precision == "bf16" else (8 if train.precision == "fp64" else 4)
    n_all = sum(x.numel() for x in model.parameters())
    n_train = sum(x.numel() for x in model.parameters() if x.requires_grad)
    two_calls = (*CFG_TWO_CALLS, *CFG_NO_GRAD_CALL)  # Wan's unconditional call: no graph, but gathered too
    calls = 2 if model_cfg.backbone in two_calls and model_cfg.true_cfg_scale > 1 else 1  # per velocity
    n_micro = max(1, train.prompts_per_iter * train.images_per_prompt // world_size // train.train_batch_size)
    rounds = n_micro * (all_gathers + sampling.num_steps * calls)
    base = (n_all - n_train) * compute * rounds
    total = n_all * compute * rounds
    if not model_cfg.shard_frozen_base:
        total -= base
    return {"total": total, "base": base if model_cfg.shard_frozen_base else 0.0, "rounds": rounds}


def embedding_bytes(cfg: Config, model) -> int:
    """Bytes of one prompt's cached text conditioning (bf16 rows; the mask and pooled vector included)."""
    model_cfg = cfg.model
    if model_cfg.backbone == "wan":  # UMT5 rows padded to max_sequence_length (+ the negative one's with CFG)
        one = model_cfg.max_sequence_length * model.config.text_dim * 2
        return one * (2 if model_cfg.true_cfg_scale > 1 else 1)
    width = model.config.joint_attention_dim
    if model_cfg.backbone == "flux":
        return model_cfg.max_sequence_length * (width * 2 + 8) + 768 * 2
    if model_cfg.backbone == "sd3":  # 77 CLIP + T5 rows and the 2048 pooled vector (+ the negative with CFG)
        one = (77 + model_cfg.max_sequence_length) * width * 2 + 2048 * 2
        return one * (2 if model_cfg.true_cfg_scale > 1 else 1)
    rows = 64 * (
        2 if model_cfg.true_cfg_scale > 1 else 1
    )  # a typical prompt (+ the negative one with true CFG)
    return rows * (width * 2 + 8)


def checkpoint_bytes(cfg: Config, n_train: int) -> float:
    """One checkpoint's tensors (``jagg.ops.checkpoint``): the trained parameters in their master dtype, two
    fp32 AdamW moments, the EMA copy (``ignore_frozen_params``: nothing frozen)."""
    master = 8 if cfg.train.precision == "fp64" else 4
    ema = n_train * master if cfg.optim.ema_decay > 0 else 0
    return float(n_train * (master + 8) + ema)


def disk_plan(cfg: Config, model) -> dict[str, float]:
    """Bytes on disk: one checkpoint (``checkpoint_bytes``) and the embedding cache (one file per train and
    eval prompt, ``embedding_bytes`` each) when ``data.embedding_cache`` is set."""
    data = cfg.data
    n_train = sum(x.numel() for x in model.parameters() if x.requires_grad)
    prompts = (data.train_limit or HPDV2_TRAIN_PROMPTS) + (data.eval_limit or HPDV2_TRAIN_PROMPTS)
    cache = prompts * embedding_bytes(cfg, model) if data.embedding_cache else 0
    return {"checkpoint": checkpoint_bytes(cfg, n_train), "embedding cache": float(cache)}


# --------------------------------------------------------------------------- sizes checked before the build
# Latent channels of every real image backbone (Flux, Qwen-Image, SD3; the world's are 3; Wan's up to 48): the rollout's terms are
# upper bounds before the model says its own. The device bound without a GPU to ask: the largest one sold.
LATENT_CHANNELS = 16
SIZE_KEYS = (  # the keys a rollout's size grows with, the one over budget named in the error
    "train.prompts_per_iter",
    "train.images_per_prompt",
    "sampling.num_steps",
    "sampling.eval_num_steps",
    "sampling.latent_size",
)


def rollout_terms(cfg: Config, world_size: int, gpu: bool | None = None) -> dict[str, tuple[str, float]]:
    """What one rank holds for one rollout (``jagg.loop.rollout.Sampler``), by term: ``(where, bytes)``, where is
    ``host`` or ``device`` (a GPU: ``gpu``, default ``train.device`` not cpu). Upper bounds: 16 latent channels,
    every step trained."""
    train, sampling = cfg.train, cfg.sampling
    n = train.prompts_per_iter * train.images_per_prompt
    local = -(-n // world_size)
    latent = (48 if cfg.model.backbone == "wan" else LATENT_CHANNELS) * latent_cells(cfg)  # Wan2.2-TI2V: 48
    wide = 8 if train.precision == "fp64" else 4
    device = "device" if (train.device != "cpu" if gpu is None else gpu) else "host"
    drawn = train.prompts_per_iter if cfg.algorithm.init_same_noise else n
    rewards = len(dict.fromkeys([*cfg.reward.weights, *cfg.reward.eval]))
    steps = sampling.num_steps
    return {
        "initial noise of the global batch, drawn on every rank": ("host", float(drawn * latent * 4)),
        "the global batch's prompts, groups, rewards and trained steps": (
            "host",
            float(n * (8 + 8 + 4 * (1 + rewards) + 8 * steps)),
        ),
        "schedules and step kinds": ("host", float((max(steps, sampling.eval_num_steps) + 1) * 24)),
        "this rank's trajectories (latents, log-probs)": (
            device,
            float((steps + 1) * local * (latent + 1) * wide),
        ),
        "this rank's stored outputs": (
            device,
            float(steps * local * latent * wide * cfg.backward.stored_outputs),
        ),
    }


def host_available() -> float | None:
    """This machine's available memory (``MemAvailable``, Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rollout_over(cfg: Config, world_size: int, limits: dict[str, float]) -> str | None:
    """The first place (host / device) whose rollout terms exceed ``limits`` (a GPU run: a device limit), or
    None."""
    totals = {"host": 0.0, "device": 0.0}
    for where, b in rollout_terms(cfg, world_size, gpu="device" in limits).values():
        totals[where] += b
    return next((w for w, b in totals.items() if w in limits and b > limits[w]), None)


def _with(cfg: Config, key: str, value: int) -> Config:
    import copy

    section, name = key.split(".")
    out = copy.copy(cfg)
    setattr(out, section, copy.copy(getattr(cfg, section)))
    setattr(getattr(out, section), name, value)
    return out


def _largest_fitting(cfg: Config, key: str, world_size: int, limits: dict[str, float]) -> int:
    """The largest value of ``key`` (others as configured) whose rollout fits ``limits`` (0: none does)."""
    lo, hi = 0, int(_get(cfg, key))
    while lo < hi:  # every term grows with every key: bisect
        mid = (lo + hi + 1) // 2
        if _rollout_over(_with(cfg, key, mid), world_size, limits) is None:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def check_sizes(
    cfg: Config, world_size: int, ranks_per_node: int = 1, host_bytes: float | None = None
) -> None:
    """``ConfigError`` naming the key and its limit when one rollout would not fit in memory, before anything is
    built or written: the host terms against this machine's available memory shared by ``ranks_per_node``
    ranks (``host_bytes``: instead of reading it), the device terms against the largest GPU sold
    (``GPU_SIZES_GB``; the host on ``train.device=cpu``). Named: the key furthest over its limit."""
    host = host_available() if host_bytes is None else host_bytes
    limits = {} if host is None else {"host": host / max(1, ranks_per_node)}
    device = cfg.train.device
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):  # a device count, no context
        limits["device"] = max(GPU_SIZES_GB) * 1e9
    where = _rollout_over(cfg, world_size, limits)
    if where is None:
        return
    fits = {k: _largest_fitting(cfg, k, world_size, limits) for k in SIZE_KEYS}
    key = max(SIZE_KEYS, key=lambda k: _get(cfg, k) / max(fits[k], 0.5))
    total = sum(b for w, b in rollout_terms(cfg, world_size, "device" in limits).values() if w == where)
    place = "this machine's available memory" if where == "host" else f"a {max(GPU_SIZES_GB)} GB GPU"
    if where == "host" and ranks_per_node > 1:
        place += f" shared by {ranks_per_node} ranks"
    limit = (
        f"at most {fits[key]} fits (the rollout alone)"
        if fits[key]
        else "no value fits with the other keys as they are"
    )
    raise ConfigError(
        f"{key}={_get(cfg, key)}: one rollout would hold {total / GIB:.3g} GiB per rank on the {where}, more "
        f"than {place} ({limits[where] / GIB:.3g} GiB); {limit}"
    )
