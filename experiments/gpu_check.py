"""``make gpu-check``: what one lent GPU can tell in one run, in stages with time budgets, into one JSON.

For the day a GPU is lent (one GPU of 80 GB, 8 minutes, no weights or downloads). Every stage builds random-init
models of the real classes and configs (``jagg.scale.architectures.KNOWN_CONFIGS``, the hub configs of the VAE and
reward models), runs, and reports ``ok`` with its measurements, ``failed`` with the error line (the next stage
still runs), or ``skipped`` with the reason (the time left was under its budget, or not selected). A stage starts
only if the time left of ``--budget-s`` (default 480 s) is at least its own budget, so the run ends within it
(a stage that runs past its budget is flagged ``over_budget``); ``STAGES`` writes each budget and why. On CUDA the
stages run in a worker child process (``--isolate``, ``StageWorker``), restarted after a failed stage, since a
CUDA error such as an illegal memory access poisons every later call in its process; a failed stage keeps the end
of its traceback. ``--sdpa`` names the attention kernels torch may pick; by default those of the paper configs'
``train.sdpa_kernels``, which a training run enables too (all four: torch's own choice, which on torch 2.11 /
H200 picked cuDNN attention and crashed the first update). Stages, in order:

1. ``environment``: torch / CUDA / cuDNN / NCCL versions, the GPU, the SDPA flags and one tiny SDPA call per
   kernel (flash / mem-efficient / cuDNN / math) checked against the math kernel.
2. ``knots_equal_exact``: knots with K = T against exact, the relative LoRA gradient error on reduced Flux at
   512 px in fp32 and bf16 (expected near 0).
3. ``wan_video``, 4. ``sd3_kl``, 5. ``flux_knots_720``: paper configs (``configs/paper/``), placed by the
   trainer's ``place_backbone`` (LoRA, checkpointing, fp32 trained weights, the frozen base and the KL copy in
   their dtypes), one micro-batch's update per backward setting: seconds, passes, peak memory against the memory
   plan of the same config (``jagg.capacity.memory_model.memory_plan`` at world size 1, the terms an update
   holds: ``PaperUpdate.plan``), and the gradient's relative error to the first setting's. A setting whose plan
   needs more than ``--memory-gb`` (80; or the GPU's own memory) is not attempted and carries the plan's reason.
   Wan2.1-1.3B at 480x832x81: exact against knots K = 4 over 10 trained steps, ``sequential`` and ``batched``;
   SD3.5-M with the fp32 base and the KL reference copy: one update of 9 samples with CFG (the config's
   backward); Flux at 720 px with LoRA: knots K = 4 against exact over the knots recipe's 15 trained steps.
6. ``qwen_meta_load``: Qwen-Image built on the meta device and materialised as the trainer does
   (``materialize_tensor_attributes``: the rotary tables must be real and equal a CPU build), then
   ``shard_from_rank0`` in a one-rank process group (NCCL on CUDA), whose forward must equal the unsharded one.
7. ``blocks``: Flux and Qwen-Image at real width, 2 blocks of each kind: per-block forward / backward /
   checkpointed backward (recompute + backward) time and activation memory, and the gradients of the whole
   reduced model with and without gradient checkpointing equal (max relative error under a tolerance).
8. ``flux_lora_512``: the full-depth Flux LoRA update of one DanceGRPO trajectory at 512 px, every variant.
9. ``vae_rewards``: the FLUX.1-dev VAE decoding a 720 px image and HPSv2.1 / PickScore / CLIPScore scoring it.
10. ``adamw_dcp``: an AdamW step on a multi-GB shard and its ``torch.distributed.checkpoint`` save (write
    bandwidth) and load (bit-equal).
11. ``trajectory_updates``: the update of one DanceGRPO trajectory (16 steps, 9 random of the first 15 trained,
    W = 3, jagg_frac 0.6) with ``BackwardSetting.backward`` for exact and JAGG in every
    ``GRAPH_MODES`` mode, with and without stored outputs, LoRA (r64 / alpha 128) and full gradients, on both
    backbones at the paper resolutions (Flux 720 px; Qwen-Image 720 and 512 px), with peak memory; the rows
    past its deadline are listed as skipped.

"Update" is the gradient computation of one micro-batch (no optimizer step, which stage 10 times). Full-parameter
runs keep bf16 weights and gradients (fp32 master weights of Qwen-Image do not fit one GPU; FSDP2 shards them
over 8 in training). Random weights are N(0, 1/fan_in), norm scales 1, biases 0, drawn on the device.

Without CUDA every stage runs its tiny version (``jagg.models.TINY_CONFIGS``, small VAE / CLIPs, a few-MB shard,
the paper configs at tiny shapes in fp32) in seconds, says so, and writes ``runs/gpu_check/gpu_check.json``, so nothing under ``results/gpu/`` ever comes
from a CPU. A Markdown summary is written beside the JSON.

    python experiments/gpu_check.py [--out results/gpu/gpu_check.json] [--tiny] [--budget-s 480]
                                    [--stages environment blocks ...] [--scratch DIR]
                                    [--sdpa flash mem_efficient cudnn math] [--[no-]isolate]
                                    [--memory-gb 80]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from jagg.capacity import memory_model
from jagg.capacity.memory_model import GIB
from jagg.capacity.pass_plan import trained_steps_per_sample
from jagg.common import atomic_write_text, command_line, run_metadata, set_threads
from jagg.config import SDPA_KERNELS, AlgorithmConfig, Config, load_config
from jagg.distributed import DistInfo
from jagg.engine.algorithms import ALGORITHMS, DanceGRPO
from jagg.engine.diagnostics import flat_grad
from jagg.engine.grpo import TrainedSteps
from jagg.engine.knots import Knots
from jagg.engine.routing import Routing
from jagg.engine.sde import sde_step_with_logprob, shifted_linear_sigmas
from jagg.engine.strategies import GRAPH_MODES, GraphRun, group_interpolation
from jagg.models import BACKBONES, TINY_CONFIGS, TextCond
from jagg.ops.node import apply_sdpa_kernels, sdpa_kernel_flags
from jagg.scale.architectures import KNOWN_CONFIGS, VAE_SCALE
from jagg.scale.distributed import materialize_tensor_attributes, transformer_blocks
from jagg.scale.lora import DEFAULT_TARGETS, apply_lora
from jagg.scale.placement import parameter_dtypes, place_backbone
from jagg.scale.pretrained import adapter_kwargs, latent_shape

GPU_OUT = "results/gpu/gpu_check.json"
CPU_OUT = "runs/gpu_check/gpu_check.json"  # runs/ is git-ignored
# The check is planned for one GPU of 80 GB (decimal, as sold; ``--memory-gb``): an update whose memory plan needs
# more is not attempted, and its row carries the plan's reason.
MEMORY_GB = 80
PAPER_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "paper"


def paper_config(name: str) -> Config:
    """``configs/paper/<name>.yaml``, the source of every paper setting this check uses."""
    return load_config(PAPER_CONFIGS / f"{name}.yaml")


def image_px(cfg: Config) -> int:
    return cfg.sampling.latent_size * VAE_SCALE


# DanceGRPO's trajectory (flux_dancegrpo.yaml): 16 steps, eta 0.3, shift 3, 60% of the first 15, W = 3, 0.6 routed.
_DANCE = paper_config("flux_dancegrpo")
NUM_STEPS, SHIFT = _DANCE.sampling.num_steps, _DANCE.sampling.shift
ETA, TIMESTEP_FRACTION, CLIP = (
    _DANCE.algorithm.noise_level,
    _DANCE.algorithm.timestep_fraction,
    _DANCE.algorithm.clip_range,
)
GROUP_SIZE, JAGG_FRAC = _DANCE.backward.group_size, _DANCE.backward.jagg_frac
_FAST = paper_config("flux_flowgrpo_fast")  # Flow-GRPO-Fast's LoRA (r64 / alpha 128)
LORA_RANK, LORA_ALPHA = _FAST.model.lora_rank, _FAST.model.lora_alpha
# px: DanceGRPO (both backbones, 720), Flow-GRPO-Fast Qwen-Image (512)
RESOLUTIONS = {
    "flux": (image_px(_DANCE),),
    "qwenimage": (
        image_px(paper_config("qwenimage_dancegrpo")),
        image_px(paper_config("qwenimage_flowgrpo_fast")),
    ),
}
# Flux: T5 padded to model.max_sequence_length (512); Qwen-Image: an unpadded prompt (a measurement choice: no
# config fixes a prompt's length)
TEXT_TOKENS = {"flux": _DANCE.model.max_sequence_length, "qwenimage": 128}
TINY_LATENT = {720: 8, 512: 4}  # CPU stand-ins for 90x90 / 64x64 latents
TINY_TEXT_TOKENS = 8
# The paper config's backward (W, jagg_frac 0.6) in every graph mode, with and without stored outputs, and
# the exact baseline; labelled by ``BackwardSetting.label``.
_SETTING = _DANCE.backward.fixed_setting()
SETTINGS = [dataclasses.replace(_SETTING, routing=Routing(strategy="exact", group_size=GROUP_SIZE))] + [
    dataclasses.replace(_SETTING, graph_mode=mode, stored_outputs=stored)
    for mode in GRAPH_MODES
    for stored in (False, True)
]


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
    _restore_buffers(model, config)
    _init_(model, seed)
    model.enable_gradient_checkpointing()
    return model


def _restore_buffers(model: nn.Module, config: dict) -> None:
    """The buffers ``__init__`` computes (SD3's positional table, Wan's rotary tables), which ``to_empty`` leaves
    uninitialised: copied from a build of the same class without its repeated blocks on the CPU (as
    ``materialize_tensor_attributes`` does for plain attributes; the tables do not depend on depth)."""
    names = [n for n, _ in model.named_buffers()]
    if not names:
        return
    shallow = {**config, **{k: 0 for k in ("num_layers", "num_single_layers") if k in config}}
    ref = dict(type(model).from_config(shallow).named_buffers())
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name not in ref:
                raise RuntimeError(f"buffer {name} of {type(model).__name__} is not in its block-free build")
            buf.copy_(ref[name])


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
    steps = TrainedSteps(
        x=x, x_next=torch.stack(x_next), sigma=sigma, sigma_next=sigma_next, old_log_prob=torch.stack(old)
    )
    loss = _DANCE.algorithm.step_loss(
        steps, torch.randn(batch, generator=g).to(device), scale=1.0 / x.shape[0]
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
    """Time ``BackwardSetting.backward`` for every setting (after a short untimed warm-up) and record peak
    memory."""
    with _autocast(device):  # kernels and allocator, outside the timing: one plain step, one JAGG group
        for strategy, w in (("exact", 1), ("jagg", GROUP_SIZE)):
            plan = group_interpolation(strategy, sigma[:w])
            GraphRun().run_plan(plan, velocity, x[:w], sigma[:w], loss, outputs[:w] if w > 1 else None)
    rows = []
    for setting in SETTINGS:
        strategy = setting.routing.strategy
        row = dict(variant=setting.label, strategy=strategy, stored_outputs=setting.stored_outputs)
        row["endpoints"] = "" if strategy == "exact" else setting.graph_mode  # the CSV's column names
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
                stats = setting.backward(velocity, loss, outputs)
            _sync(device)
            seconds = time.perf_counter() - t0
        except torch.OutOfMemoryError:
            rows.append({**row, "status": "out of memory"})
            continue
        # no list of the gradients: one kept past this row stays resident through the next variant (the first
        # H200 run's full-parameter rows carried a whole stray gradient in their resident and peak memory)
        grads = (p.grad for p in model.parameters() if p.grad is not None)
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


def check_backbone(
    name: str,
    ctx: Context,
    deadline: float,
    *,
    config: dict | None = None,
    gradients: tuple[str, ...] = ("full", "lora"),
    resolutions: tuple[int, ...] | None = None,
) -> list[dict]:
    """Rows of ``run_variants`` for one backbone: every gradient kind x resolution (``RESOLUTIONS`` default)."""
    tiny, device, batch = ctx.tiny, ctx.device, ctx.batch
    config = config or (TINY_CONFIGS[name]() if tiny else dict(KNOWN_CONFIGS[name]))
    t0 = time.perf_counter()
    transformer = build_transformer(name, config, device, ctx.dtype, ctx.seed)
    backbone = BACKBONES[name](transformer)
    n_params = sum(p.numel() for p in transformer.parameters())
    ctx.log(f"{name}: {n_params / 1e9:.2f}B parameters built on {device} in {time.perf_counter() - t0:.1f} s")
    rows = []
    for params in gradients:
        if params == "lora":
            _free(transformer, device)
            apply_lora(transformer, LORA_RANK, LORA_ALPHA, DEFAULT_TARGETS[name])
        trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
        for px in resolutions or RESOLUTIONS[name]:
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
                rows += [{**head, "variant": v.label, "status": "skipped (time budget)"} for v in SETTINGS]
                continue
            traj = make_trajectory(backbone, config, name, latent, tokens, batch, device, ctx.seed)
            for r in run_variants(transformer, *traj, device, deadline):
                rows.append({**head, **r})
                shown = f"{r['seconds']:.2f} s" if "seconds" in r else r["status"]
                mem = f", peak {r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else ""
                ctx.log(f"  {name} {px}px {params:<4} {r['variant']:<22} {shown}{mem}")
            del traj
    del backbone, transformer
    _free(None, device)
    return rows


# --------------------------------------------------------------------------- stage machinery
@dataclass
class Context:
    """What every stage gets: the device, whether it runs the tiny versions, the seed and a log function."""

    device: torch.device
    tiny: bool
    seed: int = 0
    batch: int = 1
    scratch: str | None = None
    log: Callable[[str], None] = print
    memory_gb: float = MEMORY_GB  # the GPU memory a row's plan must fit (``compare_settings``)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32


@dataclass
class Stage:
    """A named check with its time budget in seconds; ``fn(ctx, deadline)`` returns its measurements."""

    name: str
    budget_s: float
    fn: Callable[[Context, float], dict]
    about: str


def error_line(exc: BaseException) -> str:
    """``Type: message`` on one line (the last line of the traceback), message cut at 500 characters."""
    line = traceback.format_exception_only(type(exc), exc)[-1].strip().replace("\n", " ")
    return line[:500]


def run_stages(
    stages: list[Stage],
    ctx: Context,
    budget_s: float,
    *,
    selected: set[str] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_record: Callable[[list[dict]], None] | None = None,
    runner: Callable[[Stage], dict] | None = None,
) -> list[dict]:
    """Run ``stages`` in order within ``budget_s`` seconds of ``clock``; one record per stage.

    A stage starts only when the time left is at least its budget (else ``skipped``, with the time left); an
    exception ends that stage only (``failed``, with its error line), and memory is released before the next.
    ``on_record(records so far)`` after each stage (``main`` rewrites the JSON, so a killed run keeps them).
    Stage deadlines are on ``time.perf_counter``; ``clock`` (a fake one in the tests) decides what starts.
    ``runner(stage)`` runs one stage (default: in this process; ``main`` passes a ``StageWorker`` on CUDA).
    """
    runner = runner or (lambda stage: _run_stage(stage, ctx, clock))
    start = clock()
    records: list[dict] = []
    for stage in stages:
        rec = dict(name=stage.name, about=stage.about, budget_s=stage.budget_s)
        left = budget_s - (clock() - start)
        if selected is not None and stage.name not in selected:
            rec.update(status="skipped", reason="not selected (--stages)")
        elif left < stage.budget_s:
            reason = f"over budget: {math.floor(left)} s left of {budget_s:.0f} s, the stage needs {stage.budget_s:.0f} s"
            rec.update(status="skipped", reason=reason)
            ctx.log(f"[{stage.name}] skipped: {reason}")
        else:
            rec.update(runner(stage))
        records.append(rec)
        if on_record is not None:
            on_record(records)
    return records


def _run_stage(stage: Stage, ctx: Context, clock: Callable[[], float]) -> dict:
    """status / result or error / seconds / over_budget (/ peak_gib on CUDA) of one stage; frees memory."""
    ctx.log(f"[{stage.name}] {stage.about} (budget {stage.budget_s:.0f} s)")
    t0 = clock()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    try:
        rec = dict(status="ok", result=stage.fn(ctx, time.perf_counter() + stage.budget_s))
    except Exception as exc:  # a failing stage must not stop the others
        rec = dict(
            status="failed", error=error_line(exc), traceback=traceback.format_exc()[-TRACEBACK_CHARS:]
        )
        ctx.log(f"[{stage.name}] failed: {rec['error']}")
        sys.stderr.write(rec["traceback"])  # kept even if the cleanup below dies on a poisoned CUDA context
    rec["seconds"] = clock() - t0
    rec["over_budget"] = rec["seconds"] > stage.budget_s
    try:
        if ctx.cuda:
            rec["peak_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
        _free(None, ctx.device)
    except Exception as exc:  # after an illegal memory access every CUDA call fails: the record still counts
        rec["cleanup_error"] = error_line(exc)
    return rec


# the end of a failed stage's traceback (or of a crashed child's stderr) kept in its record
TRACEBACK_CHARS = 4000


# the last line of a Python traceback: "torch.AcceleratorError: CUDA error: ...", "KeyError: 'x'"
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b")


# The start of a stage worker (imports, the CUDA context): 12 to 22 s per child on the H200 run of 2026-12-04
# (``process_s`` - ``seconds``), planned as 25 s. A worker runs stages until one fails, so a run pays it once,
# and once more after each failed stage.
WORKER_START_S = 25


class StageWorker:
    """Stages run one after another in a child process (this script with ``--worker``), restarted after a
    failed stage.

    A CUDA error such as an illegal memory access poisons the process's CUDA context, so every later stage in
    it would fail too: after a failed stage (or a crash, or a kill at the stage's timeout) the next stage gets
    a fresh child, which keeps "a failing stage does not stop the others" true on a GPU. One child for the run
    (not one per stage: the H200 run paid 12 to 22 s to start each) keeps the run inside its budget. A child
    that dies without writing its record is a ``failed`` record with the end of its stderr. ``seconds`` is the
    stage's own time, measured in the child; ``process_s`` the parent's wait, a child's start included.
    """

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.proc: subprocess.Popen | None = None
        self.tmp = tempfile.mkdtemp(prefix="gpu_check_worker_")
        # kept open across stages (each stage's part read from its offset)
        self.stderr = open(os.path.join(self.tmp, "stderr.txt"), "w+")  # noqa: SIM115
        self.starts = 0

    def _alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _start(self) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), *self.argv, "--worker"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=self.stderr, text=True)
        self.starts += 1

    def run(self, stage: Stage, timeout_s: float) -> dict:
        """The record of ``stage`` run in the worker (started if none is alive)."""
        if not self._alive():
            self._start()
        record = Path(self.tmp) / f"{stage.name}.json"
        record.unlink(missing_ok=True)
        offset = self.stderr.seek(0, os.SEEK_END)
        t0 = time.perf_counter()
        self.proc.stdin.write(f"{stage.name}\t{record}\n")
        self.proc.stdin.flush()
        while not record.exists() and self._alive() and time.perf_counter() - t0 < timeout_s:
            time.sleep(0.1)
        waited = time.perf_counter() - t0
        self.stderr.seek(offset)
        stderr = self.stderr.read()
        sys.stderr.write(stderr)
        if record.exists():  # written atomically: whole
            rec = {**json.loads(record.read_text()), "process_s": waited, "worker": self.starts}
            if rec["status"] == "failed":
                self.close()
            return rec
        rc = f"killed after {timeout_s:.0f} s" if self._alive() else self.proc.returncode
        self.close()
        lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        error = next((ln for ln in reversed(lines) if _EXCEPTION_LINE.match(ln)), lines[-1] if lines else "")
        return dict(
            status="failed",
            error=f"child process ({rc}): {error.strip()}"[:500],
            traceback=stderr[-TRACEBACK_CHARS:],
            seconds=waited,
            process_s=waited,
            over_budget=waited > stage.budget_s,
            worker=self.starts,
        )

    def close(self) -> None:
        """End the child: its stdin closed (it exits between stages), killed if it does not within 10 s."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def finish(self) -> None:
        """``close`` and remove the records and the stderr file."""
        self.close()
        self.stderr.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def serve_stages(ctx: Context) -> None:
    """The ``--worker`` child: for each line ``name<TAB>record path`` on stdin, run that stage and write its
    record there; exit at the end of stdin."""
    by_name = {s.name: s for s in STAGES}
    for line in sys.stdin:
        name, record = line.rstrip("\n").split("\t")
        rec = _run_stage(by_name[name], ctx, time.perf_counter)
        atomic_write_text(Path(record), json.dumps(rec, default=str))


def _timed(fn: Callable[..., object], device: torch.device, *args) -> tuple[object, float]:
    """(fn(*args), wall seconds), synchronising CUDA before and after."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn(*args)
    _sync(device)
    return out, time.perf_counter() - t0


def _mem(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _gib(n: int | None) -> float | None:
    return None if n is None else n / 2**30


# --------------------------------------------------------------------------- 1. environment
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def _nccl_version() -> str:
    """NCCL's version as "major.minor.patch" (torch returns a tuple; older releases an int)."""
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def stage_environment(ctx: Context, deadline: float) -> dict:
    """Versions, the GPU, the SDPA flags, and one small SDPA call per kernel compared with the math kernel."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out: dict = dict(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        nccl=_nccl_version() if ctx.cuda else None,
        device=str(ctx.device),
    )
    if ctx.cuda:
        prop = torch.cuda.get_device_properties(ctx.device)
        out.update(
            gpu=prop.name, gpu_memory_gib=prop.total_memory / 2**30, capability=f"{prop.major}.{prop.minor}"
        )
    out["sdpa_flags"] = sdpa_kernel_flags()
    shape = (1, 24, 1024, 128) if ctx.cuda else (1, 2, 16, 8)
    g = torch.Generator(device=ctx.device).manual_seed(ctx.seed)
    q, k, v = (torch.randn(shape, generator=g, device=ctx.device, dtype=ctx.dtype) for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v).float()
    kernels = {}
    for name in SDPA_BACKENDS:
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                o, seconds = _timed(lambda: F.scaled_dot_product_attention(q, k, v), ctx.device)
            kernels[name.lower()] = dict(
                status="ok", seconds=seconds, max_abs_err_vs_math=float((o.float() - ref).abs().max())
            )
        except Exception as exc:  # an unavailable kernel is a finding, not a stage failure
            kernels[name.lower()] = dict(status="unavailable", error=error_line(exc))
    out["sdpa_kernels"] = kernels
    if kernels["math"]["status"] != "ok":
        raise RuntimeError("SDPA's math kernel failed: " + kernels["math"]["error"])
    return out


# --------------------------------------------------------------------------- 2. Qwen-Image meta-device load
def _qwen_forward(backbone, config: dict, latent: int, seed: int, device) -> torch.Tensor:
    """One no-grad velocity of ``backbone`` on a fixed random latent and prompt (both seeded)."""
    g = torch.Generator().manual_seed(seed)
    cond = TextCond(
        embeds=torch.randn(1, 8, config["joint_attention_dim"], generator=g),
        mask=torch.ones(1, 8, dtype=torch.long),
    ).to(device=device, dtype=next(backbone.parameters()).dtype)
    z = torch.randn(1, backbone.latent_channels, latent, latent, generator=g).to(device)
    with torch.no_grad(), _autocast(device):
        return backbone.velocity(z, torch.full((1,), 0.5, device=device), cond).float()


def _one_rank_group(ctx: Context, directory: str) -> bool:
    """A one-process group (NCCL on CUDA, gloo on CPU) unless one exists; True when this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    store = dist.FileStore(os.path.join(directory, "store"), 1)
    dist.init_process_group("nccl" if ctx.cuda else "gloo", store=store, rank=0, world_size=1)
    return True


def stage_qwen_meta_load(ctx: Context, deadline: float) -> dict:
    """Qwen-Image on the meta device, materialised as the trainer does; then ``shard_from_rank0`` on one rank.

    The full-depth build (real config on CUDA) checks that ``materialize_tensor_attributes`` gives the rotary
    tables real data equal to a CPU build's; the reduced-depth model then goes through the trainer's
    ``shard_from_rank0`` + ``shard_backbone`` (FSDP2) in a one-rank group, whose velocity must equal the
    unsharded model's.
    """
    import torch.distributed as dist

    from jagg.scale.distributed import shard_backbone, shard_from_rank0

    name, cls = "qwenimage", BACKBONES["qwenimage"].transformer_cls
    config = TINY_CONFIGS[name]() if ctx.tiny else dict(KNOWN_CONFIGS[name])
    (model, seconds) = _timed(
        lambda: build_transformer(name, config, ctx.device, ctx.dtype, ctx.seed), ctx.device
    )
    ref = cls.from_config({**config, "num_layers": 0}).pos_embed
    tables = {}
    for attr in ("pos_freqs", "neg_freqs"):
        got = getattr(model.pos_embed, attr)
        if got.is_meta or not torch.equal(got.cpu(), getattr(ref, attr)):
            raise AssertionError(f"pos_embed.{attr} after materialisation is not the CPU build's table")
        tables[attr] = list(got.shape)
    out = dict(
        params_b=sum(p.numel() for p in model.parameters()) / 1e9,
        build_materialize_s=seconds,
        resident_gib=_gib(_mem(ctx.device)),
        rotary_tables=tables,
    )
    del model
    _free(None, ctx.device)
    small = {**config, "num_layers": 2}
    base = BACKBONES[name](build_transformer(name, small, ctx.device, ctx.dtype, ctx.seed))
    latent = 4 if ctx.tiny else 64
    want = _qwen_forward(base, small, latent, ctx.seed, ctx.device)
    scratch = tempfile.mkdtemp(prefix="gpu_check_pg_", dir=ctx.scratch)
    if ctx.cuda:
        torch.cuda.set_device(ctx.device.index or 0)  # NCCL and the device mesh use the current device
    created = _one_rank_group(ctx, scratch)
    try:
        _, seconds = _timed(
            lambda: shard_from_rank0(
                base, shard_backbone, device=ctx.device, trainable=ctx.dtype, frozen=ctx.dtype
            ),
            ctx.device,
        )
        got = _qwen_forward(base, small, latent, ctx.seed, ctx.device)
    finally:
        if created:
            dist.destroy_process_group()
        shutil.rmtree(scratch, ignore_errors=True)
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
    if not (torch.isfinite(got).all() and err <= (2e-2 if ctx.cuda else 1e-5)):
        raise AssertionError(f"sharded velocity differs from the unsharded one (max rel err {err:.2e})")
    out.update(
        shard_from_rank0_s=seconds,
        sharded_vs_unsharded_max_rel_err=err,
        backend=dist.Backend.NCCL if ctx.cuda else "gloo",
    )
    return out


# --------------------------------------------------------------------------- 3. blocks at real width
BLOCK_DEPTH = 2  # blocks of each kind in the reduced-depth models
GRAD_TOL = {"cuda": 3e-2, "cpu": 1e-5}  # max relative gradient error, checkpointing on vs off (bf16 / fp32)


def _reduced_config(name: str, tiny: bool) -> dict:
    """The real (or tiny) config with ``BLOCK_DEPTH`` blocks of every kind."""
    config = TINY_CONFIGS[name]() if tiny else dict(KNOWN_CONFIGS[name])
    config.update({k: BLOCK_DEPTH for k in ("num_layers", "num_single_layers") if k in config})
    return config


def _tensors(x) -> list[torch.Tensor]:
    """The tensors in a block's output (a tensor or a tuple of them)."""
    return [x] if isinstance(x, torch.Tensor) else [t for t in x if isinstance(t, torch.Tensor)]


def _captured_block_inputs(velocity, velocity_args, blocks) -> list[tuple[tuple, dict]]:
    """Each block's (args, kwargs) from one no-grad forward (forward pre-hooks), detached."""
    seen: list[tuple[tuple, dict]] = [None] * len(blocks)

    def hook(i):
        def fn(_module, args, kwargs):
            detach = lambda v: v.detach() if isinstance(v, torch.Tensor) else v  # noqa: E731
            seen[i] = (tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()})

        return fn

    handles = [b.register_forward_pre_hook(hook(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad(), _autocast(velocity_args[0].device):
            velocity(*velocity_args)
    finally:
        for h in handles:
            h.remove()
    return seen


def _with_grad_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Fresh leaf copies of the hidden-state inputs (floating tensors) that require grad."""
    fresh = lambda v: (
        v.clone().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    )  # noqa: E731
    return tuple(fresh(a) for a in args), {k: fresh(v) for k, v in kwargs.items()}


def _block_profile(block: nn.Module, args: tuple, kwargs: dict, device) -> dict:
    """Forward / backward time and memory of one block, plain and under ``torch.utils.checkpoint``.

    ``*_saved_gib``: memory allocated by the forward and held until the backward (saved activations and the
    outputs; CUDA only); ``*_peak_over_start_gib``: the peak over the start during forward + backward.
    ``recompute_s``: checkpointed minus plain backward time (the forward the checkpoint reruns). The second
    of two runs is kept (the first warms kernels and the allocator).
    """
    from torch.utils.checkpoint import checkpoint

    row = {}
    for mode in ("plain", "checkpointed"):
        call = (
            (lambda a, k: block(*a, **k))
            if mode == "plain"
            else (lambda a, k: checkpoint(block, *a, use_reentrant=False, **k))
        )
        for _attempt in ("warmup", "timed"):
            a, k = _with_grad_inputs(args, kwargs)
            block.zero_grad(set_to_none=True)
            _free(None, device)
            m0 = _mem(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            with _autocast(device):
                raw, fwd = _timed(call, device, a, k)
            outs = _tensors(raw)
            m1 = _mem(device)
            ones = [torch.ones_like(o) for o in outs]
            _, bwd = _timed(torch.autograd.backward, device, outs, ones)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            del outs, raw, ones, a, k
        row[f"{mode}_forward_s"], row[f"{mode}_backward_s"] = fwd, bwd
        row[f"{mode}_saved_gib"] = None if m0 is None else _gib(m1 - m0)
        row[f"{mode}_peak_over_start_gib"] = None if m0 is None else _gib(peak - m0)
    row["recompute_s"] = row["checkpointed_backward_s"] - row["plain_backward_s"]
    return row


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _checkpointing_grad_error(velocity, transformer: nn.Module, velocity_args) -> tuple[float, int]:
    """(max over parameters of max|g_ckpt - g_plain| / max|g_plain|, number of gradients compared).

    Also checks that checkpointing is really on: every block runs once without it and twice with it (the
    recompute in the backward), counted by forward pre-hooks (a forward hook would miss the recompute: torch
    stops it early once the saved tensors are rebuilt).
    """
    weight = torch.randn(velocity_args[0].shape, generator=torch.Generator().manual_seed(1)).to(
        velocity_args[0].device
    )
    grads, calls = {}, {}
    blocks = transformer_blocks(transformer)
    counter = [0]
    handles = [b.register_forward_pre_hook(lambda *_: counter.__setitem__(0, counter[0] + 1)) for b in blocks]
    for on in (False, True):
        transformer.enable_gradient_checkpointing() if on else transformer.disable_gradient_checkpointing()
        transformer.zero_grad(set_to_none=True)
        counter[0] = 0
        with _autocast(weight.device):
            loss = (velocity(*velocity_args).float() * weight).sum()
        loss.backward()
        grads[on], calls[on] = _grads(transformer), counter[0]
    for h in handles:
        h.remove()
    transformer.zero_grad(set_to_none=True)
    if (calls[False], calls[True]) != (len(blocks), 2 * len(blocks)):
        raise AssertionError(
            f"block forwards without / with checkpointing: {calls}, want {len(blocks)} / twice that"
        )
    if set(grads[True]) != set(grads[False]) or not grads[True]:
        raise AssertionError("checkpointing changed which parameters get a gradient")
    err = max(
        float((grads[True][n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
        for n, g in grads[False].items()
    )
    return err, len(grads[False])


def stage_blocks(ctx: Context, deadline: float) -> dict:
    """Per-block profiles of Flux and Qwen-Image at real width (720 px) and the checkpointing gradient check."""
    out = {}
    for name in ("flux", "qwenimage"):
        config = _reduced_config(name, ctx.tiny)
        transformer = build_transformer(name, config, ctx.device, ctx.dtype, ctx.seed)
        transformer.disable_gradient_checkpointing()
        backbone = BACKBONES[name](transformer)
        latent = TINY_LATENT[720] if ctx.tiny else 720 // VAE_SCALE
        tokens = TINY_TEXT_TOKENS if ctx.tiny else TEXT_TOKENS[name]
        velocity, x, sigma, _, _ = make_trajectory(
            backbone, config, name, latent, tokens, 1, ctx.device, ctx.seed
        )
        args = (x[0], sigma[0])
        blocks = [
            (kind, b)
            for kind in ("transformer_blocks", "single_transformer_blocks")
            for b in getattr(transformer, kind, None) or []
        ]
        inputs = _captured_block_inputs(velocity, args, [b for _, b in blocks])
        rows = []
        for i, ((kind, block), (a, k)) in enumerate(zip(blocks, inputs, strict=True)):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{name} block {i}: stage budget spent")
            rows.append(dict(kind=kind, index=i, **_block_profile(block, a, k, ctx.device)))
        err, n = _checkpointing_grad_error(velocity, transformer, args)
        tol = GRAD_TOL[ctx.device.type]
        if not err <= tol:
            raise AssertionError(
                f"{name}: gradients with and without checkpointing differ: max rel err {err:.2e} > {tol}"
            )
        out[name] = dict(
            config="tiny" if ctx.tiny else "real width",
            depth={k: config[k] for k in ("num_layers", "num_single_layers") if k in config},
            image_tokens=(latent // 2) ** 2,
            text_tokens=tokens,
            blocks=rows,
            checkpointing_grad_max_rel_err=err,
            checkpointing_grad_tolerance=tol,
            gradients_compared=n,
        )
        del backbone, transformer, velocity, x, sigma, inputs
        _free(None, ctx.device)
    return out


# --------------------------------------------------------------------------- 4. full-depth Flux LoRA at 512 px
def stage_flux_lora_512(ctx: Context, deadline: float) -> dict:
    """The LoRA update of one DanceGRPO trajectory on full-depth Flux at 512 px (64x64 latent), every variant."""
    rows = check_backbone("flux", ctx, deadline, gradients=("lora",), resolutions=(512,))
    return dict(rows=rows)


# --------------------------------------------------------------------------- 5. VAE decode and reward models
_TINY_VAE = dict(
    down_block_types=["DownEncoderBlock2D"] * 2,
    up_block_types=["UpDecoderBlock2D"] * 2,
    block_out_channels=[32, 32],
    layers_per_block=1,
    latent_channels=16,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
_TINY_HF_CLIP = dict(
    text_config=dict(
        vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    ),
    vision_config=dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    ),
    projection_dim=16,
)


def _reward_models(ctx: Context) -> dict[str, Callable[[], object]]:
    """name -> builder of the jagg.scale.rewards class around a random-init model of the hub architecture."""
    import open_clip
    import transformers as tf

    from jagg.scale import architectures as arch
    from jagg.scale.rewards import CLIPScoreReward, HPSv2Reward, PickScoreReward, clip_bpe_tokenizer

    kw = dict(device=ctx.device, dtype=ctx.dtype)

    def hf_clip(text: dict, vision: dict, proj: int):
        if ctx.tiny:
            return tf.CLIPModel(tf.CLIPConfig(**_TINY_HF_CLIP))
        with torch.device(ctx.device):
            return tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=proj))

    def hps():
        if ctx.tiny:
            model = open_clip.CLIP(
                embed_dim=16,
                vision_cfg=dict(layers=1, width=32, head_width=16, patch_size=8, image_size=32),
                text_cfg=dict(context_length=77, vocab_size=49408, width=32, heads=2, layers=1),
            )
        else:
            with torch.device(ctx.device):  # random init on the GPU, not 1B parameters on the CPU first
                model = open_clip.create_model("ViT-H-14", pretrained=None, device=ctx.device)
        return HPSv2Reward.from_model(model, open_clip.get_tokenizer("ViT-H-14"), **kw)

    return {
        "hpsv2": hps,
        "pickscore": lambda: PickScoreReward.from_model(
            hf_clip(arch.CLIP_H_TEXT, arch.CLIP_H_VISION, 1024), clip_bpe_tokenizer(), **kw
        ),
        "clipscore": lambda: CLIPScoreReward.from_model(
            hf_clip(arch.CLIP_L_TEXT, arch.CLIP_L_VISION, 768), clip_bpe_tokenizer(), **kw
        ),
    }


def stage_vae_rewards(ctx: Context, deadline: float) -> dict:
    """The FLUX.1-dev VAE (random init) decoding a 90x90 latent to 720 px, then each reward model scoring it."""
    from diffusers import AutoencoderKL

    from jagg.scale import architectures as arch

    with torch.device(ctx.device):
        vae = AutoencoderKL(**(_TINY_VAE if ctx.tiny else arch.FLUX_VAE)).to(ctx.dtype).eval()
    latent = 8 if ctx.tiny else 720 // VAE_SCALE
    z = torch.randn(1, 16, latent, latent, generator=torch.Generator().manual_seed(ctx.seed)).to(
        ctx.device, ctx.dtype
    )
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    m0 = _mem(ctx.device)
    with torch.no_grad():
        decoded, seconds = _timed(vae.decode, ctx.device, z)
        decoded = decoded.sample
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else None
    images = (decoded.float().clamp(-1, 1) + 1) / 2
    if not torch.isfinite(images).all():
        raise AssertionError("the VAE decode is not finite")
    out = dict(
        vae=dict(
            params_m=sum(p.numel() for p in vae.parameters()) / 1e6,
            image=list(images.shape),
            decode_s=seconds,
            peak_over_start_gib=None if m0 is None else _gib(peak - m0),
        )
    )
    del vae, decoded
    _free(None, ctx.device)
    prompts = ["a photo of a red bicycle leaning on a wall"]
    rewards, failed = {}, []
    for name, build in _reward_models(ctx).items():
        try:
            reward, build_s = _timed(build, ctx.device)
            score, score_s = _timed(reward, ctx.device, images, prompts)
            if not torch.isfinite(score).all():
                raise AssertionError(f"{name} score is not finite")
            rewards[name] = dict(
                status="ok",
                params_m=sum(p.numel() for p in reward.model.parameters()) / 1e6,
                build_s=build_s,
                score_s=score_s,
                score=float(score[0]),
            )
            del reward
        except Exception as exc:  # one model that cannot be built offline does not hide the others
            rewards[name] = dict(status="failed", error=error_line(exc))
            failed.append(name)
        _free(None, ctx.device)
    out["rewards"] = rewards
    if failed:
        raise RuntimeError(
            f"reward models failed: {failed}: " + "; ".join(rewards[n]["error"] for n in failed)
        )
    return out


# --------------------------------------------------------------------------- 6. AdamW step and DCP save
SHARD_NUMEL = {"cuda": 2**29, "cpu": 2**19}  # fp32 elements: 2 GiB on CUDA (8 GiB with grad and Adam state)


def _dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def stage_adamw_dcp(ctx: Context, deadline: float) -> dict:
    """One AdamW step on a multi-GB fp32 shard, its DCP save (bytes, write bandwidth) and a bit-equal load."""
    import torch.distributed.checkpoint as dcp

    numel = SHARD_NUMEL[ctx.device.type]
    g = torch.Generator(device=ctx.device).manual_seed(ctx.seed)
    param = nn.Parameter(torch.randn(numel, generator=g, device=ctx.device))
    param.grad = torch.randn(numel, generator=g, device=ctx.device)
    opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=1e-4, fused=ctx.cuda or None)
    _, first_s = _timed(opt.step, ctx.device)  # allocates the state
    _, step_s = _timed(opt.step, ctx.device)
    state = {"model": {"shard": param.detach()}, "optim": opt.state_dict()}
    root = tempfile.mkdtemp(prefix="gpu_check_dcp_", dir=ctx.scratch)
    try:
        path = os.path.join(root, "checkpoint")
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            _, save_s = _timed(lambda: dcp.save(state, checkpoint_id=path), ctx.device)
            written = _dir_bytes(path)
            target = {"model": {"shard": torch.empty_like(param.detach())}}
            _, load_s = _timed(lambda: dcp.load(target, checkpoint_id=path), ctx.device)
        if not torch.equal(target["model"]["shard"], param.detach()):
            raise AssertionError("the DCP load differs from what was saved")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return dict(
        shard_gib=numel * 4 / 2**30,
        first_step_s=first_s,
        step_s=step_s,
        written_gib=written / 2**30,
        save_s=save_s,
        write_gib_per_s=written / 2**30 / save_s,
        load_shard_s=load_s,
        scratch=ctx.scratch or tempfile.gettempdir(),
    )


# --------------------------------------------------------------------------- 7. trajectory updates
def stage_trajectory_updates(ctx: Context, deadline: float) -> dict:
    """The original check: every variant, LoRA and full, both backbones, at the paper resolutions."""
    rows = []
    for name in ("flux", "qwenimage"):
        rows += check_backbone(name, ctx, deadline)
    return dict(rows=rows)


def stage_knots_equal_exact(ctx: Context, deadline: float) -> dict:
    """Knots with K = T (every trained step a knot) against exact, the gradient comparison the other stages lack:
    the LoRA gradient of one DanceGRPO trajectory on Flux with ``BLOCK_DEPTH`` blocks of each kind at real width,
    512 px, in fp32 and under bf16 autocast. Expected near 0 (the same steps back-propagated through the knots
    code path: a stacked forward and hat weights of 0 / 1); a large error is a bug in that path on the device."""
    device, rows = ctx.device, []
    config = _reduced_config("flux", ctx.tiny)
    latent = TINY_LATENT[512] if ctx.tiny else 512 // VAE_SCALE
    tokens = TINY_TEXT_TOKENS if ctx.tiny else TEXT_TOKENS["flux"]
    for precision in ("fp32", "bf16"):
        if time.perf_counter() > deadline:
            rows.append(dict(precision=precision, status="skipped (time budget)"))
            continue
        if precision == "bf16" and device.type != "cuda":  # the trajectory is sampled in bf16 on CUDA only
            rows.append(
                dict(precision=precision, status="skipped (bf16 autocast runs on CUDA only, _autocast)")
            )
            continue
        transformer = build_transformer("flux", config, device, torch.float32, ctx.seed)
        apply_lora(transformer, LORA_RANK, LORA_ALPHA, DEFAULT_TARGETS["flux"])
        backbone = BACKBONES["flux"](transformer)
        velocity, x, sigma, outputs, loss = make_trajectory(
            backbone, config, "flux", latent, tokens, ctx.batch, device, ctx.seed
        )
        steps = x.shape[0]
        trained = [p for p in transformer.parameters() if p.requires_grad]
        grads = {}
        for name, routing in (
            ("exact", Routing(strategy="exact", group_size=GROUP_SIZE)),
            ("knots", Knots(count=steps, placement="index")),
        ):
            transformer.zero_grad(set_to_none=True)
            with _autocast(device) if precision == "bf16" else contextlib.nullcontext():
                dataclasses.replace(_SETTING, routing=routing).backward(velocity, loss, outputs)
            grads[name] = torch.cat([p.grad.float().flatten() for p in trained])
        err = float((grads["knots"] - grads["exact"]).norm() / grads["exact"].norm())
        rows.append(dict(precision=precision, trained_steps=steps, knots=steps, rel_error=err, status="ok"))
        ctx.log(f"  knots K = T = {steps} vs exact, {precision}: relative error {err:.2e}")
        del backbone, transformer, grads
        _free(None, device)
    return dict(comparisons=rows)


# --------------------------------------------------------------------------- 9-11. paper configs against the plan
# The memory plan's per-rank terms (``jagg.capacity.memory_model.memory_plan``, at world size 1) that an update
# here holds: the placed transformer, its gradients and the KL copy. Not held: the optimizer's state and step
# (no step), the EMA, the text encoders, the VAE and the reward models (none is built).
UPDATE_PLAN_TERMS = (
    "transformer weights",
    "frozen base",
    "transformer buffers",
    "gradients",
    "unsharded",
    "KL reference",
)
# The shapes a CPU run gives each paper config: tiny transformers of the same classes (``TINY_CONFIGS``), fp32
TINY_SHAPES = {
    "wan": ["sampling.latent_frames=2", "sampling.latent_size=4", "sampling.latent_width=6"],
    "sd3": ["sampling.latent_size=8"],
    "flux": ["sampling.latent_size=8"],
}
TINY_RUN = ["model.max_sequence_length=8", "train.precision=fp32"]


@dataclass
class PaperUpdate:
    """One paper config as a stage runs it: the config (``configs/paper/``, the stage's overrides, tiny shapes on
    the CPU), the transformer config it builds (the published one, ``memory_model.transformer_config``, or the
    tiny one of the same class) and that transformer on the meta device (the plan counts it)."""

    cfg: Config
    config: dict
    meta: nn.Module

    @classmethod
    def load(cls, name: str, overrides: list[str], tiny: bool) -> PaperUpdate:
        backbone = paper_config(name).model.backbone
        cfg = load_config(
            PAPER_CONFIGS / f"{name}.yaml", overrides + (TINY_SHAPES[backbone] + TINY_RUN if tiny else [])
        )
        config = TINY_CONFIGS[backbone]() if tiny else dict(memory_model.transformer_config(cfg)[0])
        with torch.device("meta"):
            meta = BACKBONES[backbone].transformer_cls.from_config(config)
        if cfg.model.lora_rank > 0:
            apply_lora(
                meta,
                cfg.model.lora_rank,
                cfg.model.lora_alpha,
                cfg.model.lora_targets or DEFAULT_TARGETS[backbone],
            )
        return cls(cfg, config, meta)

    @property
    def trained_steps(self) -> int:
        return trained_steps_per_sample(self.cfg)

    def plan(self, setting, limit_gb: float) -> dict:
        """The plan of ``setting``'s update of one micro-batch on one GPU: the ``UPDATE_PLAN_TERMS`` and the
        update's activations (``BackwardSetting.cost``'s graphs alive), the CUDA context and the allocator's
        slack as the plan assumes them; ``fits`` against ``limit_gb``, else ``reason``. ``run_total_gib``: the
        whole run's plan on one GPU (optimizer, encoders, VAE, rewards too), for reference."""
        cfg = self.cfg
        cost = setting.cost(self.trained_steps, batch=cfg.train.train_batch_size, stored_outputs=True)
        mp = memory_model.memory_plan(cfg, 1, cost.graphs_alive, setting.holds_gradients, model=self.meta)
        terms = {k: v for k, v in mp.gpu.items() if k.startswith(UPDATE_PLAN_TERMS)}
        terms["activations (update)"] = mp.activations[mp.checkpointing]
        allocated = sum(terms.values())
        needed = (
            allocated * (1 + memory_model.ALLOCATOR_SLACK[mp.expandable_segments]) + memory_model.CUDA_CONTEXT
        )
        out = dict(
            plan_allocated_gib=allocated / GIB,
            plan_needed_gib=needed / GIB,
            plan_terms_gib={k: v / GIB for k, v in terms.items()},
            plan_graphs_alive=cost.graphs_alive,
            run_total_gib=mp.total() / GIB,
            fits=needed <= limit_gb * 1e9,
        )
        if not out["fits"]:
            largest = sorted(terms.items(), key=lambda kv: -kv[1])[:2]
            out["reason"] = (
                f"the plan needs {needed / GIB:.1f} GiB ({', '.join(f'{k} {v / GIB:.1f}' for k, v in largest)}), "
                f"more than {limit_gb:g} GB ({limit_gb * 1e9 / GIB:.1f} GiB)"
            )
        return out

    def build(self, ctx: Context) -> tuple[nn.Module, nn.Module | None]:
        """(backbone, KL reference or None), random-init and placed by the trainer's ``place_backbone``: LoRA,
        gradient checkpointing, fp32 trained weights, the frozen base in ``model.base_dtype``'s dtype."""
        cfg = self.cfg
        frozen = parameter_dtypes(cfg.train.precision, cfg.model.base_dtype)[1]
        transformer = build_transformer(cfg.model.backbone, self.config, ctx.device, frozen, ctx.seed)
        backbone = BACKBONES[cfg.model.backbone](transformer, **adapter_kwargs(cfg.model))
        return place_backbone(
            cfg, backbone, device=ctx.device, dist=DistInfo(), reference=cfg.algorithm.kl_beta > 0
        )

    def trajectory(self, backbone, reference, ctx: Context):
        """(velocity, loss, outputs) of one micro-batch at its trained steps, as ``Trainer.grpo_loss`` gives them:
        random prompt embeddings (and the negative prompt's, with CFG) of the plan's text length, straight-
        path latents at the steps' times, the velocity there (the stored outputs), an SDE step from it (the next
        latents and old log-probs: ratio 1), and the config's GRPO step loss (KL against ``reference``)."""
        cfg, device = self.cfg, ctx.device
        m, s, a = cfg.model, cfg.sampling, cfg.algorithm
        batch, g = cfg.train.train_batch_size, torch.Generator().manual_seed(ctx.seed)
        alg = ALGORITHMS[a.name](a, cfg.backward)
        steps = alg.trained_steps(alg.step_kinds(s.num_steps, g), batch, g).T  # (T, B), sorted by time
        # SD3.5-M's scheduler (``sampling.schedule: scheduler``): the same shift-3 sigmas
        sig = shifted_linear_sigmas(s.num_steps, s.shift).float()
        sigma, sigma_next = sig[steps].to(device), sig[steps + 1].to(device)
        config = self.meta.config
        width = getattr(config, "joint_attention_dim", None) or config.text_dim  # Wan: UMT5 rows of text_dim
        tokens = memory_model.text_tokens(m)
        pooled = getattr(config, "pooled_projection_dim", None)
        cond = TextCond(
            embeds=torch.randn(batch, tokens, width, generator=g),
            mask=torch.ones(batch, tokens, dtype=torch.long),
            pooled=None if pooled is None else torch.randn(batch, pooled, generator=g),
        )
        if m.true_cfg_scale > 1:  # a stand-in for the negative prompt's conditioning, of the same shapes
            cond.neg_embeds, cond.neg_mask = torch.randn_like(cond.embeds), cond.mask.clone()
            cond.neg_pooled = None if pooled is None else torch.randn_like(cond.pooled)
        # the trainer's velocity (``Trainer.velocity``): bf16 autocast under bf16 precision
        cond, autocast = cond.to(device), torch.bfloat16 if cfg.train.precision == "bf16" else None
        velocity = backbone.bind(cond, autocast=autocast)
        shape = latent_shape(cfg, backbone.latent_channels)
        x0, eps = (torch.randn(batch, *shape, generator=g) for _ in range(2))
        s_ = sigma.cpu().view(*sigma.shape, *[1] * len(shape))
        x = ((1 - s_) * x0 + s_ * eps).to(device)
        outputs, x_next, old = [], [], []
        with torch.no_grad():
            for i in range(x.shape[0]):
                v = velocity(x[i], sigma[i])
                step = sde_step_with_logprob(
                    x[i], v, sigma[i], sigma_next[i], kind=a.sde_kind, noise_level=a.noise_level
                )
                outputs.append(v)
                x_next.append(step.prev_sample)
                old.append(step.log_prob)
        trained = TrainedSteps(
            x=x, x_next=torch.stack(x_next), sigma=sigma, sigma_next=sigma_next, old_log_prob=torch.stack(old)
        )
        ref = None if reference is None else reference.bind(cond, autocast=autocast)
        adv = torch.randn(batch, generator=g).to(device)
        loss = a.step_loss(trained, adv, scale=1.0 / x.shape[0], ref_velocity=ref)
        return velocity, loss, torch.stack(outputs)


def time_update(setting, model: nn.Module, velocity, loss, outputs, device) -> dict:
    """``setting.backward`` of one micro-batch from zero gradients: seconds (CUDA synchronised), the pass counts,
    the peak allocated over the whole update (CUDA), and whether the gradient is finite."""
    model.zero_grad(set_to_none=True)
    _free(None, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stats, seconds = _timed(lambda: setting.backward(velocity, loss, outputs), device)
    grads = (p.grad for p in model.parameters() if p.grad is not None)
    finite = all(bool(torch.isfinite(gr).all()) for gr in grads) and math.isfinite(stats.loss)
    return dict(
        status="ok" if finite else "ok (non-finite gradient)",
        seconds=seconds,
        forward_passes=stats.forward_passes,
        forward_passes_with_grad=stats.forward_passes_with_grad,
        backward_passes=stats.backward_passes,
        backward_calls=stats.backward_calls,
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    )


def compare_settings(run: PaperUpdate, settings: dict, ctx: Context, deadline: float) -> dict:
    """Each of ``settings`` (label -> ``BackwardSetting``; exact first) on the same micro-batch: its plan, and
    where the plan fits, its update's seconds, passes and peak (CUDA) against the plan, and its gradient's
    relative error to the first setting's. A row the plan does not fit is not attempted (its reason kept); a
    row past the stage's deadline is skipped."""
    limit = ctx.memory_gb if not ctx.cuda else min(ctx.memory_gb, _device_gb(ctx.device))
    plans = {label: run.plan(s, limit) for label, s in settings.items()}
    rows = [dict(setting=label, **plans[label]) for label in settings]
    head = dict(
        config=run.cfg.model.backbone + ("" if not ctx.tiny else " (tiny)"),
        trained_steps=run.trained_steps,
        batch=run.cfg.train.train_batch_size,
        latent_cells=list(latent_shape(run.cfg, 1)[1:]),
        params_b=sum(p.numel() for p in run.meta.parameters()) / 1e9,
        trainable_m=sum(p.numel() for p in run.meta.parameters() if p.requires_grad) / 1e6,
        memory_limit_gb=limit,
    )
    if not any(r["fits"] for r in rows):
        for r in rows:
            r["status"] = "skipped (" + r["reason"] + ")"
        return dict(**head, rows=rows)
    backbone, reference = run.build(ctx)
    velocity, loss, outputs = run.trajectory(backbone, reference, ctx)
    first = None
    for r, setting in zip(rows, settings.values(), strict=True):
        if not r["fits"]:
            r["status"] = "skipped (" + r["reason"] + ")"
        elif time.perf_counter() > deadline:
            r["status"] = "skipped (time budget)"
        else:
            r.update(time_update(setting, backbone, velocity, loss, outputs, ctx.device))
            grad = flat_grad(p for p in backbone.parameters() if p.requires_grad).float()
            first = grad if first is None else first
            r["grad_rel_error_vs_first"] = float((grad - first).norm() / first.norm().clamp_min(1e-30))
            if r["peak_gib"] is not None:
                r["peak_over_plan"] = r["peak_gib"] / r["plan_allocated_gib"]
            ctx.log(
                f"  {r['setting']:<22} {r['seconds']:.2f} s, plan {r['plan_allocated_gib']:.1f} GiB"
                + ("" if r["peak_gib"] is None else f", peak {r['peak_gib']:.1f} GiB")
            )
    del backbone, reference, velocity, loss, outputs, first
    _free(None, ctx.device)
    return dict(**head, rows=rows)


def _device_gb(device) -> float:
    return torch.cuda.get_device_properties(device).total_memory / 1e9


def _knots_settings(cfg: Config) -> dict:
    """exact, then the config's knots in the ``sequential`` and ``batched`` graph modes."""
    knots = cfg.backward.planned_setting()
    return {
        "exact": knots.exact,
        **{
            f"knots K={knots.routing.count}/{m}": dataclasses.replace(knots, graph_mode=m)
            for m in ("sequential", "batched")
        },
    }


# Wan2.1-T2V-1.3B at Flash-GRPO's 480x832 px x 81 frames, its knots recipe with 10 trained steps (the window of the
# first 10 of 20 that Flash-GRPO draws its step from), one video per micro-batch, CFG as configured. Without the
# KL term: its reference forwards (2 calls at every trained step, the same in every setting) would take ~30 s of
# the 8 minutes and change no difference between the settings; sd3_kl checks the KL copy.
WAN_CONFIG = "wan/wan21_flashgrpo_knots"
WAN_OVERRIDES = [
    "algorithm.name=flowgrpo_fast",
    "algorithm.sde_window_size=10",
    "algorithm.sde_window_range=[0, 10]",
    "algorithm.kl_beta=0",
]


def stage_wan_video(ctx: Context, deadline: float) -> dict:
    """Wan2.1-1.3B at 480x832x81: exact against knots K = 4 over 10 trained steps, per-knot (``sequential``) and
    stacked (``batched``): update seconds and peak memory against the memory plan."""
    run = PaperUpdate.load(WAN_CONFIG, [*WAN_OVERRIDES, f"train.train_batch_size={ctx.batch}"], ctx.tiny)
    return compare_settings(run, _knots_settings(run.cfg), ctx, deadline)


SD3_CONFIG = "sd3/sd35m_flowgrpo"  # fp32 base, KL 0.01 (the reference copy), CFG 4.5, micro-batches of 9


def stage_sd3_kl(ctx: Context, deadline: float) -> dict:
    """SD3.5-M with its fp32 base and the KL reference copy: one update of a micro-batch of 9 samples with CFG in
    the config's backward, peak memory against the plan."""
    run = PaperUpdate.load(SD3_CONFIG, [], ctx.tiny)
    return compare_settings(run, {"configured": run.cfg.backward.planned_setting()}, ctx, deadline)


FLUX_KNOTS_CONFIG = "flux_dancegrpo_knots"  # 720 px, every step of DanceGRPO's first 15 trained, K = 4
FLUX_KNOTS_OVERRIDES = [
    f"model.lora_rank={LORA_RANK}",
    f"model.lora_alpha={LORA_ALPHA}",
]  # full in the recipe


def stage_flux_knots_720(ctx: Context, deadline: float) -> dict:
    """Flux at 720 px with LoRA (Flow-GRPO-Fast's r64 / alpha 128): knots K = 4 against exact over every trained
    step of the knots recipe, timing (and the knots gradient's error to exact's: an approximation, not 0)."""
    overrides = [*FLUX_KNOTS_OVERRIDES, f"train.train_batch_size={ctx.batch}"]
    run = PaperUpdate.load(FLUX_KNOTS_CONFIG, overrides, ctx.tiny)
    return compare_settings(run, _knots_settings(run.cfg), ctx, deadline)


# The time plan, on one H100 (no H100 run yet: the H200 run of 2026-12-04 measured the older stages, the new ones
# are estimated from their passes): one worker start (WORKER_START_S) + the budgets = 465 s of the 480 s default.
# A stage starts only if the time left covers its budget; the issue-55 stages run first, the older ones
# after, and the last of them (trajectory_updates) takes what is left within its 90 s.
#   environment           10  H200: 0.6 s
#   knots_equal_exact     15  two reduced Flux models (2 + 2 blocks) at 512 px, 9 steps twice: a few seconds
#   wan_video            100  ~0.7 s per 32,760-token forward (2.9e14 FLOPs at ~400 TFLOP/s): the trajectory's
#                             10 x 2 CFG forwards, exact's 10 x 5 (forward, no-grad CFG call, recompute, backward
#                             as 2) and each knots mode's 4 x 5: ~90 forwards, ~65 s, + build
#   sd3_kl                30  18 rows (9 x CFG) of 1,229 tokens, 2.2 B parameters: ~0.3 s per forward; 9 trajectory
#                             + 9 KL-reference forwards and the configured update's: ~15 s, + the fp32 build
#   flux_knots_720        45  H200: 9 trained steps of exact at 720 px in 4.6 s; 15 here (~8 s), 2 x 4 knots, the
#                             trajectory's 15 no-grad forwards, the build: ~30 s
#   qwen_meta_load        20  H200: 4.6 s
#   blocks                30  H200: 12.8 s
#   flux_lora_512         50  H200: 35.7 s
#   vae_rewards           20  H200: 6.6 s
#   adamw_dcp             30  H200: 16.7 s (disk bound)
#   trajectory_updates    90  H200: 151 s for all its rows: the rows past its deadline are skipped (they are listed)
STAGES = [
    Stage("environment", 10, stage_environment, "versions, GPU, SDPA kernels"),
    Stage("knots_equal_exact", 15, stage_knots_equal_exact, "knots with K = T against exact: gradient error"),
    Stage(
        "wan_video", 100, stage_wan_video, "Wan2.1-1.3B 480x832x81: exact vs knots K = 4, against the plan"
    ),
    Stage(
        "sd3_kl", 30, stage_sd3_kl, "SD3.5-M fp32 base + KL copy: one update of 9 with CFG, against the plan"
    ),
    Stage("flux_knots_720", 45, stage_flux_knots_720, "Flux 720 px LoRA: knots K = 4 vs exact, timing"),
    Stage(
        "qwen_meta_load",
        20,
        stage_qwen_meta_load,
        "Qwen-Image meta-device build, materialise, shard_from_rank0",
    ),
    Stage(
        "blocks",
        30,
        stage_blocks,
        "Flux / Qwen-Image blocks at real width: time, memory, checkpointing grads",
    ),
    Stage(
        "flux_lora_512", 50, stage_flux_lora_512, "full-depth Flux LoRA update of one trajectory at 512 px"
    ),
    Stage("vae_rewards", 20, stage_vae_rewards, "Flux VAE decode at 720 px, HPSv2.1 / PickScore / CLIPScore"),
    Stage("adamw_dcp", 30, stage_adamw_dcp, "AdamW step and DCP save / load of a multi-GB shard"),
    Stage("trajectory_updates", 90, stage_trajectory_updates, "one trajectory's update, every JAGG mode"),
]


# --------------------------------------------------------------------------- report
def _variant_table(rows: list[dict]) -> list[str]:
    """The trajectory-update rows as a Markdown table."""
    lines = [
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
    return lines


def _plan_table(result: dict) -> list[str]:
    """A ``compare_settings`` result as a Markdown table: each setting's plan against its update."""
    lines = [
        f"{result['config']}: {result['params_b']:.2f} B parameters, {result['trainable_m']:.1f} M trained, "
        f"latent {'x'.join(map(str, result['latent_cells']))}, {result['batch']} per micro-batch, "
        f"{result['trained_steps']} trained steps; a row fits if its plan is within {result['memory_limit_gb']:g} GB.",
        "",
        "| setting | graphs alive | plan GiB | peak GiB | peak / plan | s | fwd (grad) | bwd passes "
        "| grad rel. err. vs first | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        cells = [r["setting"], r["plan_graphs_alive"], f"{r['plan_allocated_gib']:.1f}"]
        if "seconds" in r:
            peak = r.get("peak_gib")
            cells += [
                "" if peak is None else f"{peak:.1f}",
                f"{r['peak_over_plan']:.2f}" if "peak_over_plan" in r else "",
                f"{r['seconds']:.2f}",
                f"{r['forward_passes']} ({r['forward_passes_with_grad']})",
                r["backward_passes"],
                f"{r['grad_rel_error_vs_first']:.1e}",
            ]
        else:
            cells += [""] * 6
        lines.append("| " + " | ".join(str(c) for c in [*cells, r["status"]]) + " |")
    return lines


def to_markdown(report: dict) -> str:
    """A human summary of the JSON: one line per stage, then the trajectory tables."""
    meta, tiny = report["meta"], report["meta"]["tiny"]
    lines = [
        "# GPU check",
        "",
        f"Hardware: {meta['hardware']}. git {meta['git_sha']}, torch {meta['versions']['torch']}.",
        f"Command: `{meta['command']}`. {report['wall_s']:.0f} s of a {report['budget_s']:.0f} s budget.",
        "",
    ]
    if tiny:
        lines += [
            "**Tiny configs, not the real architectures** (no CUDA or `--tiny`): the numbers only show that the",
            "machinery runs; they say nothing about GPU time or memory.",
            "",
        ]
    lines += ["| stage | status | s | budget s | note |", "|---|---|---|---|---|"]
    for s in report["stages"]:
        note = s.get("error") or s.get("reason") or ("over its budget" if s.get("over_budget") else "")
        secs = f"{s['seconds']:.1f}" if "seconds" in s else ""
        lines.append(f"| {s['name']} | {s['status']} | {secs} | {s['budget_s']:.0f} | {note} |")
    for s in report["stages"]:
        result = s.get("result") or {}
        if s["status"] == "ok" and "rows" in result:
            table = _plan_table(result) if "memory_limit_gb" in result else _variant_table(result["rows"])
            lines += ["", f"## {s['name']}", "", *table]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help=f"JSON path (default {GPU_OUT} with CUDA, {CPU_OUT} without)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs even with CUDA (a quick smoke run)")
    ap.add_argument(
        "--stages", nargs="+", default=None, choices=[s.name for s in STAGES], help="default: all"
    )
    ap.add_argument("--batch", type=int, default=1, help="trajectories per micro-batch (DanceGRPO updates 1)")
    ap.add_argument(
        "--budget-s", type=float, default=480.0, help="total time; a stage needing more is skipped"
    )
    ap.add_argument(
        "--scratch", default=None, help="directory for the DCP write (default: the system temp dir)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--memory-gb",
        type=float,
        default=MEMORY_GB,
        help="GPU memory (decimal GB) an update's plan must fit, else it is not attempted (and the GPU's own)",
    )
    ap.add_argument(
        "--sdpa",
        nargs="+",
        default=None,
        choices=SDPA_KERNELS,
        help="allow only these SDPA kernels (default: the paper configs' train.sdpa_kernels, as training runs; "
        "all four: torch's own choice)",
    )
    ap.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each stage in its own process, so a CUDA crash does not poison the next (default: on with CUDA)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a child of --isolate
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.budget_s <= 0:
        ap.error(f"--budget-s must be > 0 seconds, got {args.budget_s}")
    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    if args.memory_gb <= 0:
        ap.error(f"--memory-gb must be > 0 GB, got {args.memory_gb}")
    set_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    out = Path(args.out or default_out(cuda))
    if args.scratch:
        Path(args.scratch).mkdir(parents=True, exist_ok=True)
    args.sdpa = args.sdpa or _DANCE.train.sdpa_kernels  # what a training run enables (jagg.ops.node)
    apply_sdpa_kernels(args.sdpa)
    ctx = Context(
        device=device,
        tiny=args.tiny or not cuda,
        seed=args.seed,
        batch=args.batch,
        scratch=args.scratch,
        memory_gb=args.memory_gb,
    )
    if args.worker:  # a child of StageWorker: the stages named on stdin
        ctx.log = lambda line: print(line, flush=True)
        serve_stages(ctx)
        return 0
    if not cuda:
        print("gpu_check: no CUDA device: every stage runs its tiny version on the CPU (seconds);")
        print(f"gpu_check: these are not GPU numbers, and they go to {out}, not {GPU_OUT}.")
    start = time.perf_counter()
    meta = run_metadata(
        outputs=("results/gpu/*",),  # its own report: left out of the dirty check
        command=command_line("experiments/gpu_check.py", argv),
        seed=args.seed,
        config=vars(args),
        tiny=ctx.tiny,
        device=str(device),
        trajectory=dict(
            num_steps=NUM_STEPS,
            eta=ETA,
            shift=SHIFT,
            timestep_fraction=TIMESTEP_FRACTION,
            group_size=GROUP_SIZE,
            jagg_frac=JAGG_FRAC,
            lora=(LORA_RANK, LORA_ALPHA),
        ),
        architectures="tiny" if ctx.tiny else KNOWN_CONFIGS,
    )

    def write(stages: list[dict]) -> dict:
        report = dict(meta=meta, budget_s=args.budget_s, wall_s=time.perf_counter() - start, stages=stages)
        atomic_write_text(out, json.dumps(report, indent=1, default=str) + "\n")
        return report

    selected = set(args.stages) if args.stages else None
    isolate = cuda if args.isolate is None else args.isolate
    worker = StageWorker(argv) if isolate else None
    runner = (lambda stage: worker.run(stage, 2 * stage.budget_s + 60)) if isolate else None
    meta["isolated_stages"] = isolate
    try:
        records = run_stages(STAGES, ctx, args.budget_s, selected=selected, on_record=write, runner=runner)
    finally:
        if worker is not None:
            worker.finish()
    meta["worker_starts"] = 0 if worker is None else worker.starts
    report = write(records)
    md = to_markdown(report)
    atomic_write_text(out.with_suffix(".md"), md)
    print(md)
    print(f"wrote {out} and {out.with_suffix('.md')} in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
