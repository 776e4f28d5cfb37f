"""FSDP2 for a backbone's transformer, loading its shards from rank 0, and a collective counter.

``shard_backbone`` applies ``torch.distributed.fsdp.fully_shard`` to every transformer block and then to the
transformer itself (the root unit holds the embedders and the output head), the layout DanceGRPO's FSDP
wrap policy and Flow-GRPO's Qwen-Image FSDP use per block. Each ``fully_shard`` unit is one "sharded group":
after a backward FSDP2 reduce-scatters its gradients once. Hence (docs/decisions.md):
    exact strategy  W backward calls per group   -> W reduce-scatters per unit
    JAGG            one joint backward over two forwards -> 1 reduce-scatter per unit
(``tests/test_distributed.py`` counts them with ``CollectiveCounter``). Apply LoRA before sharding.

Loading without the full model on every rank: ``shard_from_rank0`` shards a model whose weights only rank 0
holds (the others build it on the meta device) and sends each rank its slices; ``cast_parameters`` keeps
frozen parameters (the LoRA base) in the compute dtype and only the trained ones in fp32.

CPU: gloo works for FSDP2 in torch 2.14 (FSDP2 calls ``dist.reduce_scatter_single`` /
``dist.all_gather_single``, both implemented by gloo); use one thread per process. The process group itself and
the rank helpers every run uses, one process included (``DistInfo``, ``full_tensor``), are ``jagg.distributed``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from jagg.distributed import DistInfo

# torch.distributed functions FSDP2 (and DDP / manual code) may call to move gradients or parameters.
COLLECTIVES = (
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "all_reduce",
)


def transformer_blocks(transformer: nn.Module, strict: bool = True) -> list[nn.Module]:
    """The repeated blocks of a diffusers DiT: Flux double + single stream, Qwen-Image / SD3 joint blocks, Wan's
    ``blocks``. ``strict``: a model without any is an error (else [])."""
    blocks: list[nn.Module] = []
    for attr in ("transformer_blocks", "single_transformer_blocks", "blocks"):
        blocks.extend(getattr(transformer, attr, None) or [])
    if not blocks and strict:
        raise ValueError(f"{type(transformer).__name__} has no transformer_blocks to shard")
    return blocks


def shard_backbone(
    backbone: nn.Module,
    mesh=None,
    *,
    reshard_after_forward: bool = True,
    mp_policy=None,
    shard_frozen: bool = True,
) -> nn.Module:
    """``fully_shard`` each block of ``backbone.transformer`` and then the transformer (root), in place; the
    same for each of ``backbone.networks`` where there are several (Wan2.2-A14B's two experts).

    ``mesh``: a 1-D device mesh (default: all ranks, ``init_device_mesh(device_type, (world_size,))``).
    ``mp_policy``: e.g. ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``.
    ``shard_frozen=False`` (``model.shard_frozen_base: false``, LoRA): the frozen parameters are FSDP2's
    ``ignored_params``, plain tensors replicated on every rank that no collective ever moves; only the trained
    ones (the adapters) become DTensors, all-gathered and reduce-scattered per unit (ZeRO-2-like, as
    Flow-GRPO trains its LoRA). Returns the backbone; its ``transformer`` and blocks are now ``FSDPModule``s.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    kw = dict(
        mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy or MixedPrecisionPolicy()
    )
    for transformer in _networks(backbone):  # Wan2.2-A14B: each expert its own blocks and root
        if not shard_frozen:  # parameters a child unit manages are left out of the root's anyway
            kw["ignored_params"] = {p for p in transformer.parameters() if not p.requires_grad}
        for block in transformer_blocks(transformer):
            fully_shard(block, **kw)
        fully_shard(transformer, **kw)
    return backbone


def _networks(backbone: nn.Module) -> tuple[nn.Module, ...]:
    """``Backbone.networks`` (both Wan2.2-A14B experts), or the ``transformer`` of a bare module."""
    return getattr(backbone, "networks", (backbone.transformer,))


def fsdp_units(backbone: nn.Module) -> list[nn.Module]:
    """The ``fully_shard`` units (sharded groups) of a sharded backbone: blocks then root."""
    from torch.distributed.fsdp import FSDPModule

    return [m for net in _networks(backbone) for m in net.modules() if isinstance(m, FSDPModule)]


def _largest_tensor_bytes(args: tuple) -> int:
    """Bytes of the largest tensor among a collective's arguments: the unsharded buffer (an all-gather's
    output, a reduce-scatter's input, an all-reduce's tensor)."""
    flat = [a for x in args for a in (x if isinstance(x, list | tuple) else [x])]
    return max((t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor)), default=0)


@contextmanager
def CollectiveCounter(
    names: tuple[str, ...] = COLLECTIVES, sizes: Counter | None = None
) -> Iterator[Counter]:
    """Count calls of ``torch.distributed`` collectives inside the block (outermost calls only).

    FSDP2 looks the functions up on the ``torch.distributed`` module at call time, so patching the module
    attributes sees every call it makes. Nested calls (one collective implemented with another) count once.
    ``sizes``, when given, is filled with the bytes of each collective's unsharded buffer, summed per name.
    """
    counts: Counter = Counter()
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    depth = [0]

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if depth[0] == 0:
                counts[name] += 1
                if sizes is not None:
                    sizes[name] += _largest_tensor_bytes((*args, *kwargs.values()))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for n, fn in originals.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield counts
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of every gradient (DTensor grads are all-gathered; call on every rank).

    Units left unsharded by ``set_reshard_after_backward(False)`` are resharded first: while unsharded,
    ``named_parameters`` returns the gathered tensors, whose ``.grad`` is None (the gradient lives on the
    sharded parameter).
    """
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    out = {}
    for n, p in module.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def cast_parameters(
    module: nn.Module,
    *,
    trainable: torch.dtype,
    frozen: torch.dtype,
    device: torch.device | str | None = None,
) -> nn.Module:
    """In place: trainable parameters to ``trainable``, frozen ones to ``frozen``, floating buffers to
    ``trainable`` (and everything to ``device`` when given). Free on the meta device. Returns ``module``.

    With LoRA under bf16 autocast this keeps the frozen base in bf16 (the dtype it was loaded in) and only
    the adapters in fp32; full fine-tuning has no frozen parameters.
    """

    def convert(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t if device is None else t.to(device)
        frozen_param = isinstance(t, nn.Parameter) and not t.requires_grad
        return t.to(device=device, dtype=frozen if frozen_param else trainable)

    return module._apply(convert)


def _non_persistent_buffers(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(owner, name) of every buffer ``state_dict`` leaves out."""
    return [
        (m, b)
        for m in module.modules()
        for b in sorted(m._non_persistent_buffers_set)
        if m._buffers.get(b) is not None
    ]


def _config_root(path: str, modules: dict[str, nn.Module]) -> str | None:
    """The path of the innermost module at or above ``path`` that diffusers can rebuild (``from_config``)."""
    parts = path.split(".") if path else []
    for k in range(len(parts), -1, -1):
        prefix = ".".join(parts[:k])
        if hasattr(modules[prefix], "from_config") and hasattr(modules[prefix], "config"):
            return prefix
    return None


def materialize_tensor_attributes(module: nn.Module, device: torch.device | str) -> int:
    """Fill, on ``device``, the plain tensor attributes that building on the meta device left without data.

    Tensors an ``__init__`` computes and keeps as plain attributes (neither parameters nor buffers: diffusers'
    ``QwenEmbedRope.pos_freqs`` / ``neg_freqs``, complex rotary tables kept out of the buffers so that a dtype
    cast cannot drop their imaginary part) are not moved by ``to_empty`` nor sent by a state dict. They are
    recomputed from a copy of their diffusers model built on the CPU without its repeated blocks
    (``num_layers`` / ``num_single_layers`` = 0; the tables do not depend on depth). Call it before the first
    forward (diffusers memoises per-device copies of the tables). Returns how many were filled. Used by
    ``shard_from_rank0`` and ``experiments/gpu_check.py``.
    """
    modules = dict(module.named_modules())
    rebuilt: dict[str, dict[str, nn.Module]] = {}
    filled = 0
    for path, owner in modules.items():
        for attr, value in list(vars(owner).items()):
            if not (isinstance(value, torch.Tensor) and value.is_meta):
                continue
            root = _config_root(path, modules)
            if root is None:
                raise RuntimeError(f"{path}.{attr} is a meta tensor that no diffusers model can recompute")
            if root not in rebuilt:
                config = dict(modules[root].config)
                config.update({k: 0 for k in ("num_layers", "num_single_layers") if k in config})
                with torch.device("cpu"):
                    rebuilt[root] = dict(type(modules[root]).from_config(config).named_modules())
            rel = path[len(root) :].lstrip(".")
            setattr(owner, attr, getattr(rebuilt[root][rel], attr).to(device))
            filled += 1
    return filled


def shard_from_rank0(
    module: nn.Module,
    shard: Callable[[nn.Module], object],
    *,
    device: torch.device | str,
    trainable: torch.dtype,
    frozen: torch.dtype,
) -> nn.Module:
    """Shard ``module`` in place (``shard``, e.g. ``shard_backbone``) with the weights rank 0 holds; no other
    rank ever holds more than its shards plus one full tensor in transit. Call on every rank.

    Rank 0's ``module`` holds the weights; the other ranks' may be built on the meta device (what
    ``jagg.scale.pretrained.load_backbone(meta=True)`` returns) or hold anything (it is overwritten). Every
    rank moves its copy to the meta device (rank 0 keeps a reference to its full state dict), sets the
    parameter dtypes (``cast_parameters``: free on meta), shards, allocates only its shards on ``device``
    (``to_empty``) and receives them from rank 0 tensor by tensor
    (``set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))``:
    each tensor is broadcast in rank 0's dtype and copied, converted, into the local shard). Buffers left
    out of ``state_dict`` are broadcast too; plain tensor attributes left on the meta device (Qwen-Image's
    rotary tables) are recomputed (``materialize_tensor_attributes``). Host peak: rank 0 its loaded weights
    + its shards; other ranks their shards + the largest single tensor.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    info = DistInfo.current()
    full = module.state_dict() if info.is_main else {}  # references: rank 0's weights stay alive until loaded
    extra = [(m, b, m._buffers[b]) for m, b in _non_persistent_buffers(module)]
    module.to("meta")
    cast_parameters(module, trainable=trainable, frozen=frozen)
    shard(module)
    module.to_empty(device=device)
    set_model_state_dict(
        module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    del full
    with torch.no_grad():
        for m, b, value in extra:
            buf = m._buffers[b]
            if info.is_main:
                buf.copy_(value)
            dist.broadcast(buf, src=0)
    materialize_tensor_attributes(module, device)
    return module


def broadcast_module(module: nn.Module, *, device: torch.device | str) -> nn.Module:
    """Every parameter and buffer of an unsharded ``module`` set to rank 0's, on ``device`` (call on every
    rank; other ranks' copies may be on the meta device). For small frozen copies (the KL reference)."""
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        module.to_empty(device=device)
    else:
        module.to(device)
    with torch.no_grad():
        for t in (*module.parameters(), *module.buffers()):
            dist.broadcast(t.data, src=0)
    return module
