"""JAGG / knots as a Flow-Factory trainer: ``JaggGRPOTrainer``, whose ``optimize`` runs one plan per micro-batch.

Flow-Factory (github.com/X-GenGroup/Flow-Factory, source only, read at a0b2bc5) trains with
``GRPOTrainer.optimize`` (``src/flow_factory/trainers/grpo.py``): per micro-batch and per trained timestep, one
``adapter.forward`` (transformer, then ``adapter.scheduler.step`` for the log-prob of the stored next latent), the
clipped PPO loss, and ``accelerator.backward(loss)`` inside ``accelerator.accumulate``. ``plan_optimize`` gives
the same per-step losses to one ``BackwardSetting``: the velocity is ``adapter.forward(..., return_kwargs=
['noise_pred'])``, step i's loss is their loss on ``adapter.scheduler.step(noise_pred=v, ...)``, and every backward
call goes through ``accelerator.backward`` (``accelerate_backward``). A Flow-Factory user selects it with one
key: ``train.trainer_type: jagg.integrations.flow_factory.JaggGRPOTrainer`` (the class is defined when
Flow-Factory is importable). Their KL term (``kl_beta > 0``, ``kl_type`` ``v-based`` or ``x-based``) is part
of each step's loss: the reference model's outputs at the T trained steps are computed first, under ``no_grad``
and ``adapter.use_ref_parameters()`` (T forwards, as their loop runs one per step), and the term is a function of
the step's velocity, so it routes through the plan like the surrogate. Stored outputs are never read
(Flow-Factory's samples keep no model outputs).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from jagg.engine.knots import Knots
from jagg.engine.routing import BackwardSetting
from jagg.engine.strategies import GroupStats
from jagg.integrations import accelerate_backward


class AdapterVelocity:
    """``velocity(z, t)``: the adapter's transformer output (``noise_pred``), as its ``forward`` computes it from
    the micro-batch's other inputs (prompt embeddings, ids, guidance). Stacked rows (n x B) run B at a time.

    A two-expert adapter (their Wan2.2 ones, ``src/flow_factory/models/wan/wan2_t2v.py`` ``forward``: ``transformer``
    at timesteps t >= ``boundary_timestep``, ``transformer_2`` below) declares the switch as ``expert_boundaries``,
    in the unit of the times the plan reads (their timesteps in [0, 1000]), so no knot interval or group spans it.
    Their forward picks one expert per call from its first row's t: B rows of one step at a time never mix."""

    def __init__(self, adapter, inputs: dict[str, Any], batch: int) -> None:
        self.adapter, self.inputs, self.batch = adapter, inputs, batch
        self.expert_boundaries = _boundary_timesteps(adapter, inputs)

    def __call__(self, z: Tensor, t: Tensor) -> Tensor:
        t = t.expand(z.shape[0]) if t.ndim == 0 else t
        rows = range(0, z.shape[0], self.batch)
        return torch.cat([self._one(z[r : r + self.batch], t[r : r + self.batch]) for r in rows])

    def _one(self, z: Tensor, t: Tensor) -> Tensor:
        kwargs = {
            **self.inputs,
            "t": t,
            "latents": z,
            "compute_log_prob": False,
            "return_kwargs": ["noise_pred"],
        }
        return self.adapter.forward(**kwargs).noise_pred


def _boundary_timesteps(adapter, inputs: dict[str, Any]) -> tuple[float, ...]:
    """Their forward's switch of expert: the ``boundary_timestep`` it is passed (a training arg), else the
    pipeline's ``boundary_ratio`` x the scheduler's ``num_train_timesteps``, as their forward defaults it; () for an
    adapter of one transformer (no ``boundary_ratio``)."""
    boundary = inputs.get("boundary_timestep")
    if boundary is None:
        ratio = getattr(getattr(getattr(adapter, "pipeline", None), "config", None), "boundary_ratio", None)
        if ratio is not None:
            boundary = ratio * adapter.scheduler.config.num_train_timesteps
    return () if boundary is None else (float(boundary),)


@dataclass
class KLTerm:
    """Their KL penalty of one micro-batch: ``beta`` x mean((q - ref)^2), q the step's ``noise_pred``
    (``v-based``) or the SDE step's mean ``next_latents_mean`` (``x-based``); ``ref`` (T, B, ...) the same quantity
    from the reference parameters."""

    beta: float
    kind: str
    ref: Tensor


KL_KINDS = ("v-based", "x-based")


@dataclass
class MicroBatchLoss:
    """``GRPOTrainer.optimize``'s loss of one micro-batch, step by step (a ``StepLoss``): step i's log-prob from
    ``scheduler.step(noise_pred=v, ...)``, the ratio to the old log-prob, their clipped surrogate (asymmetric
    ``clip_range`` (low, high) added to 1, advantages clamped to ``adv_clip_range``), its mean. ``x`` (T, B, ...);
    ``sigma`` (T, B) their timesteps (decreasing)."""

    scheduler: Any
    x: Tensor
    x_next: Tensor
    sigma: Tensor
    sigma_next: Tensor
    old_log_prob: Tensor  # (T, B)
    advantages: Tensor  # (B,) clamped
    clip_range: tuple[float, float]
    noise_level: float
    kl: KLTerm | None = None

    def step(self, i: int, v: Tensor, keys: list[str], log_prob: bool = True):
        """Their ``scheduler.step`` at trained step i with velocity ``v``, returning ``keys``."""
        return self.scheduler.step(
            noise_pred=v,
            timestep=self.sigma[i],
            latents=self.x[i],
            timestep_next=self.sigma_next[i],
            next_latents=self.x_next[i],
            compute_log_prob=log_prob,
            return_dict=True,
            return_kwargs=keys,
            noise_level=self.noise_level,
        )

    def __call__(self, i: int, v: Tensor) -> Tensor:
        x_based = self.kl is not None and self.kl.kind == "x-based"
        out = self.step(i, v, ["log_prob", "next_latents_mean"] if x_based else ["log_prob"])
        ratio = torch.exp(out.log_prob - self.old_log_prob[i])
        low, high = self.clip_range
        unclipped = -self.advantages * ratio
        clipped = -self.advantages * torch.clamp(ratio, 1.0 + low, 1.0 + high)
        loss = torch.mean(torch.maximum(unclipped, clipped))
        if self.kl is None:
            return loss
        # their kl_div: a per-sample mean over the other dims, then the batch mean (equal sizes: one mean)
        q = out.next_latents_mean if x_based else v
        return loss + self.kl.beta * torch.mean((q - self.kl.ref[i]) ** 2)

    def with_reference(self, trainer, velocity) -> MicroBatchLoss:
        """This loss with their KL term where ``trainer.enable_kl_loss``: the reference outputs at the T trained
        steps, computed now (no grad, ``adapter.use_ref_parameters()``), as their loop computes one per step."""
        args = trainer.training_args
        if not getattr(trainer, "enable_kl_loss", False):
            return self
        if args.kl_type not in KL_KINDS:
            raise ValueError(f"train.kl_type must be one of {KL_KINDS}, got {args.kl_type!r}")
        refs, x_based = [], args.kl_type == "x-based"
        with torch.no_grad(), trainer.adapter.use_ref_parameters():
            for i in range(self.x.shape[0]):
                v = velocity(self.x[i], self.sigma[i])
                refs.append(self.step(i, v, ["next_latents_mean"], False).next_latents_mean if x_based else v)
        return replace(self, kl=KLTerm(float(args.kl_beta), args.kl_type, torch.stack(refs)))


def micro_batch_loss(trainer, batch: dict[str, Any]) -> MicroBatchLoss:
    """The ``MicroBatchLoss`` of ``batch`` (``BaseSample.stack``'s dict) over ``adapter.scheduler.train_timesteps``,
    indexed the way ``GRPOTrainer.optimize`` indexes it (latent / log-prob index maps; t_next 0 after the last)."""
    args, scheduler = trainer.training_args, trainer.adapter.scheduler
    steps = [int(j) for j in scheduler.train_timesteps]
    lmap, pmap, ts = batch["latent_index_map"], batch["log_prob_index_map"], batch["timesteps"]
    zero = torch.zeros_like(ts[:, 0])
    adv = torch.clamp(batch["advantage"], args.adv_clip_range[0], args.adv_clip_range[1])
    return MicroBatchLoss(
        scheduler=scheduler,
        x=torch.stack([batch["all_latents"][:, lmap[j]] for j in steps]),
        x_next=torch.stack([batch["all_latents"][:, lmap[j + 1]] for j in steps]),
        sigma=torch.stack([ts[:, j] for j in steps]),
        sigma_next=torch.stack([ts[:, j + 1] if j + 1 < ts.shape[1] else zero for j in steps]),
        old_log_prob=torch.stack([batch["log_probs"][:, pmap[j]] for j in steps]),
        advantages=adv,
        clip_range=tuple(args.clip_range),
        noise_level=scheduler.noise_level,
    )


def optimize_micro_batch(
    trainer, batch: dict[str, Any], inputs: dict[str, Any], setting: BackwardSetting
) -> GroupStats:
    """One micro-batch of ``GRPOTrainer.optimize`` as one plan. Their loop enters ``accelerator.accumulate`` once
    per trained step; this enters it as often (the optimizer steps at the same micro-batches when their
    accumulation count is a multiple of T) and runs the plan, through ``accelerator.backward``, in the last, where
    it clips and steps as they do."""
    acc, loss = trainer.accelerator, micro_batch_loss(trainer, batch)
    setting = replace(setting, stored_outputs=False, backward_fn=accelerate_backward(acc))
    velocity = AdapterVelocity(trainer.adapter, inputs, loss.x.shape[1])
    loss = loss.with_reference(trainer, velocity)  # their KL term, where they have one
    components = trainer.adapter.trainable_components
    for k in range(loss.x.shape[0]):
        with acc.accumulate(*components):
            if k < loss.x.shape[0] - 1:
                continue
            stats = setting.backward(velocity, loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(
                    trainer.adapter.get_trainable_parameters(), trainer.training_args.max_grad_norm
                )
                trainer.optimizer.step()
                trainer.optimizer.zero_grad()
                trainer.step += 1
    return stats


def forward_inputs(trainer, batch: dict[str, Any]) -> dict[str, Any]:
    """What ``adapter.forward`` takes besides (t, latents): their ``filter_kwargs`` of training args and batch."""
    names = set(inspect.signature(trainer.adapter.forward).parameters)
    merged = {**dict(trainer.training_args), "noise_level": trainer.adapter.scheduler.noise_level, **batch}
    return {
        k: v for k, v in merged.items() if k in names and k not in ("t", "latents", "t_next", "next_latents")
    }


def plan_optimize(
    trainer, samples: Sequence[Any], setting: BackwardSetting, stack, order
) -> list[GroupStats]:
    """``GRPOTrainer.optimize`` with one plan per micro-batch: for each inner epoch, the samples in ``order(epoch)``
    (their seeded permutation), micro-batches of ``per_device_batch_size`` stacked by ``stack``
    (``BaseSample.stack``), each through ``optimize_micro_batch``."""
    args, device = trainer.training_args, trainer.accelerator.device
    size, stats = args.per_device_batch_size, []
    for inner_epoch in range(args.num_inner_epochs):
        shuffled = [samples[i] for i in order(inner_epoch)]
        trainer.adapter.train()
        with trainer.autocast():
            for start in range(0, len(shuffled), size):
                batch = stack([s.to(device) for s in shuffled[start : start + size]])
                stats.append(optimize_micro_batch(trainer, batch, forward_inputs(trainer, batch), setting))
    return stats


def _define_trainer():
    """``JaggGRPOTrainer(GRPOTrainer)`` when Flow-Factory imports (a source tree on the path; not on the package
    index), else None. ``backward`` on the trainer (default: knots K = 4, time, sequential) is its setting."""
    try:
        grpo = importlib.import_module("flow_factory.trainers.grpo")
    except ImportError:
        return None

    class JaggGRPOTrainer(grpo.GRPOTrainer):
        backward = BackwardSetting(
            routing=Knots(count=4, placement="time"), graph_mode="sequential", stored_outputs=False
        )

        def optimize(self, samples) -> None:
            def order(inner_epoch):
                return torch.randperm(
                    len(samples),
                    generator=grpo.create_generator(self.training_args.seed, self.epoch, inner_epoch),
                )

            self.last_stats = plan_optimize(self, samples, self.backward, grpo.BaseSample.stack, order)

    return JaggGRPOTrainer


JaggGRPOTrainer = _define_trainer()
