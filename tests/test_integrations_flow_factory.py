"""``jagg.integrations.flow_factory``: one plan per micro-batch through ``accelerator.backward``, checked against
Flow-Factory's ``GRPOTrainer.optimize`` contract (a0b2bc5, ``src/flow_factory/trainers/grpo.py``).

Always: a trainer in their shape (an adapter whose ``forward`` runs a transformer then ``scheduler.step``, their
batch dict with index maps, accelerate's real ``Accelerator`` with accumulation over every trained step) and
their per-step loop transcribed as the reference: exact routing and knots K = T move the weights as their loop
does, with and without their KL term (v-based and x-based); K knots make K ``accelerator.backward`` calls per
micro-batch where they make T; a two-expert adapter (their Wan2.2 routing) has its switch declared, so knots
stay on one expert's steps.
With ``FLOW_FACTORY`` pointing at a Flow-Factory source tree (``git clone
https://github.com/X-GenGroup/Flow-Factory && git -C Flow-Factory checkout a0b2bc5``; its ``src`` is put on the
path): the real ``GRPOTrainer`` subclass is defined and its ``optimize`` is ours. Skipped otherwise, with that reason.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from jagg.engine.knots import Knots
from jagg.engine.routing import BackwardSetting, Routing
from jagg.engine.sde import sde_step_with_logprob
from jagg.integrations.flow_factory import optimize_micro_batch, plan_optimize

B, T, D = 2, 4, 8


class Args(dict):
    """Their training args: a mapping (``**self.training_args``) read by attribute."""

    __getattr__ = dict.__getitem__


class Scheduler:
    """Their SDE scheduler's ``step`` contract: timesteps in [0, 1000], log-prob of ``next_latents``."""

    train_timesteps = list(range(T))
    noise_level = 0.7

    def step(
        self,
        noise_pred,
        timestep,
        latents,
        timestep_next,
        next_latents,
        compute_log_prob,
        return_dict,
        return_kwargs,
        noise_level,
    ):
        out = sde_step_with_logprob(
            latents,
            noise_pred,
            timestep / 1000,
            timestep_next / 1000,
            kind="flow_grpo",
            noise_level=noise_level,
            prev_sample=next_latents,
        )
        return SimpleNamespace(log_prob=out.log_prob, noise_pred=noise_pred, next_latents_mean=out.mean)


class Adapter(nn.Module):
    """Their adapter: ``forward`` = transformer on (latents, t, prompt_embeds), then ``scheduler.step``."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Sequential(nn.Linear(2 * D + 1, 32), nn.Tanh(), nn.Linear(32, D)).double()
        self.scheduler = Scheduler()
        # the reference weights: the initial ones moved, so that the KL term has a gradient from the start
        self.ref = copy.deepcopy(self.transformer).requires_grad_(False)
        with torch.no_grad():
            for p in self.ref.parameters():
                p.add_(0.1 * torch.randn_like(p))

    @contextlib.contextmanager
    def use_ref_parameters(self):
        live, self.transformer = self.transformer, self.ref
        try:
            yield
        finally:
            self.transformer = live

    @property
    def trainable_components(self):
        return [self.transformer]

    def get_trainable_parameters(self):
        return list(self.transformer.parameters())

    def network(self, t, boundary_timestep):
        return self.transformer

    def forward(
        self,
        t,
        latents,
        prompt_embeds,
        t_next=None,
        next_latents=None,
        noise_level=None,
        compute_log_prob=True,
        return_kwargs=(),
        boundary_timestep=None,
    ):
        h = torch.cat([latents, prompt_embeds, t.expand(latents.shape[0])[:, None] / 1000], dim=1)
        noise_pred = self.network(t, boundary_timestep)(h)
        if not compute_log_prob and return_kwargs == ["noise_pred"]:
            return SimpleNamespace(noise_pred=noise_pred)
        return self.scheduler.step(
            noise_pred, t, latents, t_next, next_latents, True, True, return_kwargs, noise_level
        )


class TwoExpertAdapter(Adapter):
    """Their Wan2.2 adapters' routing (wan2_t2v.py ``forward``): ``transformer`` at t >= ``boundary_timestep``
    (default: the pipeline's ``boundary_ratio`` 0.5 x the scheduler's 1000 train timesteps), ``transformer_2``
    below, one expert per call by its first row's t. ``batch``'s timesteps 1000, 700 | 400, 100 straddle it."""

    def __init__(self):
        super().__init__()
        self.transformer_2 = copy.deepcopy(self.transformer)
        with torch.no_grad():  # a different network, as A14B's low-noise expert
            for p in self.transformer_2.parameters():
                p.add_(0.5 * torch.randn_like(p))
        self.pipeline = SimpleNamespace(config=SimpleNamespace(boundary_ratio=0.5))
        self.scheduler.config = SimpleNamespace(num_train_timesteps=1000)

    def network(self, t, boundary_timestep):
        if boundary_timestep is None:
            boundary_timestep = (
                self.pipeline.config.boundary_ratio * self.scheduler.config.num_train_timesteps
            )
        t = t[0] if t.ndim == 1 else t
        return self.transformer if t >= boundary_timestep else self.transformer_2

    @property
    def trainable_components(self):
        return [self.transformer, self.transformer_2]

    def get_trainable_parameters(self):
        return [*self.transformer.parameters(), *self.transformer_2.parameters()]


def batch(seed=0):
    """Their stacked batch: all_latents (B, T+1, D), timesteps (B, T), log_probs (B, T), index maps, advantage."""
    g = torch.Generator().manual_seed(seed)
    ts = torch.linspace(1000, 100, T, dtype=torch.float64).expand(B, T).clone()
    return {
        "all_latents": torch.randn(B, T + 1, D, generator=g, dtype=torch.float64),
        "timesteps": ts,
        "log_probs": torch.randn(B, T, generator=g, dtype=torch.float64) * 1e-3 - 1.0,
        "latent_index_map": torch.arange(T + 1),
        "log_prob_index_map": torch.arange(T),
        "advantage": torch.randn(B, generator=g, dtype=torch.float64),
        "prompt_embeds": torch.randn(B, D, generator=g, dtype=torch.float64),
    }


def trainer(accum, kl_type=None, kl_beta=0.0, adapter=Adapter):
    from accelerate import Accelerator

    torch.manual_seed(0)
    adapter = adapter()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    optimizer = acc.prepare(torch.optim.SGD(adapter.get_trainable_parameters(), lr=0.1))
    calls = []
    real = acc.backward
    acc.backward = lambda loss, **kw: (calls.append(1), real(loss, **kw))[1]
    args = Args(
        per_device_batch_size=B,
        num_inner_epochs=1,
        seed=0,
        adv_clip_range=(-5.0, 5.0),
        clip_range=(-1e-3, 1e-3),
        max_grad_norm=1e9,
        kl_type=kl_type,
        kl_beta=kl_beta,
    )
    tr = SimpleNamespace(
        adapter=adapter, accelerator=acc, optimizer=optimizer, training_args=args, step=0, epoch=0
    )
    tr.enable_kl_loss = kl_beta > 0.0
    tr.autocast = lambda: torch.autocast("cpu", enabled=False)
    return tr, calls


def their_loop(tr, b):
    """``GRPOTrainer.optimize``'s body for one micro-batch (a0b2bc5, grpo.py lines 219-330; no logging)."""
    acc, args = tr.accelerator, tr.training_args
    for timestep_index in tr.adapter.scheduler.train_timesteps:
        with acc.accumulate(*tr.adapter.trainable_components):
            old_log_prob = b["log_probs"][:, b["log_prob_index_map"][timestep_index]]
            t = b["timesteps"][:, timestep_index]
            nt = b["timesteps"].shape[1]
            t_next = b["timesteps"][:, timestep_index + 1] if timestep_index + 1 < nt else torch.zeros_like(t)
            latents = b["all_latents"][:, b["latent_index_map"][timestep_index]]
            next_latents = b["all_latents"][:, b["latent_index_map"][timestep_index + 1]]
            inputs = (t, latents, b["prompt_embeds"], t_next, next_latents, tr.adapter.scheduler.noise_level)
            key = {"v-based": "noise_pred", "x-based": "next_latents_mean"}.get(args.kl_type)
            out = tr.adapter.forward(*inputs, True, ["log_prob"] + ([key] if key else []))
            adv = torch.clamp(b["advantage"], args.adv_clip_range[0], args.adv_clip_range[1])
            ratio = torch.exp(out.log_prob - old_log_prob)
            unclipped = -adv * ratio
            clipped = -adv * torch.clamp(ratio, 1.0 + args.clip_range[0], 1.0 + args.clip_range[1])
            loss = torch.mean(torch.maximum(unclipped, clipped))
            if tr.enable_kl_loss:  # grpo.py lines 280-311
                with torch.no_grad(), tr.adapter.use_ref_parameters():
                    ref = getattr(tr.adapter.forward(*inputs, False, [key]), key)
                q = getattr(out, key)
                kl_div = torch.mean(torch.mean((q - ref) ** 2, dim=tuple(range(1, q.ndim)), keepdim=True))
                loss = loss + args.kl_beta * kl_div
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(tr.adapter.get_trainable_parameters(), args.max_grad_norm)
                tr.optimizer.step()
                tr.optimizer.zero_grad()
                tr.step += 1


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def weights(tr):
    return torch.cat([p.detach().flatten() for p in tr.adapter.get_trainable_parameters()])


SETTINGS = {
    "exact": BackwardSetting(routing=Routing.exact()),
    "knotsT": BackwardSetting(routing=Knots(count=T, placement="time"), graph_mode="joint"),
    "knotsT_seq": BackwardSetting(routing=Knots(count=T, placement="time"), graph_mode="sequential"),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_one_plan_moves_the_weights_as_their_loop(name):
    batches = [batch(0), batch(1)]  # two micro-batches, one optimizer step (accumulation over 2 x T steps)
    theirs, their_calls = trainer(accum=2 * T)
    start = weights(theirs)
    for b in batches:
        their_loop(theirs, b)
    ours, our_calls = trainer(accum=2 * T)
    assert torch.equal(weights(ours), start)
    for b in batches:
        optimize_micro_batch(ours, b, {"prompt_embeds": b["prompt_embeds"]}, SETTINGS[name])
    assert theirs.step == ours.step == 1
    moved, want = weights(ours) - start, weights(theirs) - start
    assert want.norm() > 0 and ((moved - want).norm() / want.norm()) < 1e-10
    assert len(their_calls) == 2 * T and len(our_calls) == 2 * (
        T if name == "exact" else 1 if name == "knotsT" else T
    )


@pytest.mark.parametrize("kl_type", ["v-based", "x-based"])
@pytest.mark.parametrize("name", ["exact", "knotsT"])
def test_their_kl_term_moves_the_weights_as_their_loop(name, kl_type):
    """With kl_beta > 0 the plan carries their KL term (reference outputs under use_ref_parameters): the same
    weights as their loop; the control: the same run without the term moves them measurably elsewhere."""
    b = batch(0)

    def run(plan, kl_beta):
        tr, _ = trainer(accum=T, kl_type=kl_type, kl_beta=kl_beta)
        start = weights(tr)
        if plan:
            optimize_micro_batch(tr, b, {"prompt_embeds": b["prompt_embeds"]}, SETTINGS[name])
        else:
            their_loop(tr, b)
        return weights(tr) - start

    want, moved, without = run(False, 0.5), run(True, 0.5), run(True, 0.0)
    assert ((moved - want).norm() / want.norm()) < 1e-10
    assert ((without - want).norm() / want.norm()) > 1e-2


def test_an_unknown_kl_type_is_refused_before_any_backward():
    tr, calls = trainer(accum=T, kl_type="score-based", kl_beta=0.1)
    b = batch(0)
    with pytest.raises(ValueError, match="train.kl_type must be one of"):
        optimize_micro_batch(tr, b, {"prompt_embeds": b["prompt_embeds"]}, SETTINGS["exact"])
    assert not calls and tr.step == 0


def test_knots_make_k_backward_calls_per_micro_batch_through_the_accelerator():
    tr, calls = trainer(accum=T)
    b = batch(0)
    setting = BackwardSetting(routing=Knots(count=2, placement="time"), graph_mode="sequential")
    stats = optimize_micro_batch(tr, b, {"prompt_embeds": b["prompt_embeds"]}, setting)
    assert len(calls) == stats.backward_calls == stats.backward_passes == 2 and tr.step == 1


def test_a_two_expert_adapter_declares_its_switch_and_plans_each_expert_apart():
    """Their Wan2.2 routing: the velocity declares the switch in their timesteps (boundary_ratio x
    num_train_timesteps, or the ``boundary_timestep`` their forward is passed), so K = 2 knots over the 4 steps
    become the two ends of each expert's steps (all 4: 4 backward calls), which moves the weights as their loop.
    Before, ``AdapterVelocity`` declared nothing: knots [0, 3], one interval interpolating across both experts."""
    from jagg.integrations.flow_factory import AdapterVelocity

    b = batch(0)
    b["advantage"] = b["advantage"].abs()  # their ratios are < 1 here: positive advantages pass the clip
    inputs = {"prompt_embeds": b["prompt_embeds"]}
    assert AdapterVelocity(TwoExpertAdapter(), inputs, B).expert_boundaries == (500.0,)
    assert AdapterVelocity(TwoExpertAdapter(), {**inputs, "boundary_timestep": 800}, B).expert_boundaries == (
        800.0,
    )
    assert AdapterVelocity(Adapter(), inputs, B).expert_boundaries == ()
    theirs, _ = trainer(accum=T, adapter=TwoExpertAdapter)
    start = weights(theirs)
    their_loop(theirs, b)
    ours, calls = trainer(accum=T, adapter=TwoExpertAdapter)
    setting = BackwardSetting(routing=Knots(count=2, placement="time"), graph_mode="sequential")
    optimize_micro_batch(ours, b, inputs, setting)
    moved, want = weights(ours) - start, weights(theirs) - start
    half = want.numel() // 2  # both experts moved
    assert want[:half].norm() > 0 and want[half:].norm() > 0
    assert len(calls) == 4 and ((moved - want).norm() / want.norm()) < 1e-10


def test_plan_optimize_walks_their_micro_batches():
    """plan_optimize: per inner epoch their permutation, micro-batches of per_device_batch_size, stacked."""
    tr, calls = trainer(accum=T)
    samples = [SimpleNamespace(i=i, to=lambda device, i=i: i) for i in range(2 * B)]

    def stack(items):  # BaseSample.stack stand-in: one batch per micro-batch
        return batch(sum(items))

    stats = plan_optimize(tr, samples, SETTINGS["exact"], stack, order=lambda epoch: torch.arange(2 * B))
    assert len(stats) == 2 and len(calls) == 2 * T and tr.step == 2


SOURCE = os.environ.get("FLOW_FACTORY")


@pytest.mark.skipif(
    not SOURCE, reason="FLOW_FACTORY is not set: point it at a Flow-Factory source tree at a0b2bc5"
)
def test_the_real_grpo_trainer_subclass():
    sys.path.insert(0, str(Path(SOURCE) / "src"))
    import importlib

    import jagg.integrations.flow_factory as ff

    ff = importlib.reload(ff)
    from flow_factory.trainers.grpo import GRPOTrainer

    assert ff.JaggGRPOTrainer is not None and issubclass(ff.JaggGRPOTrainer, GRPOTrainer)
    assert ff.JaggGRPOTrainer.optimize is not GRPOTrainer.optimize
    assert ff.JaggGRPOTrainer.backward.key == "knots/K4/time/sequential"
    # the contract the always-run test transcribes is the tree's: the same indexing, loss and backward calls
    import inspect

    theirs = inspect.getsource(GRPOTrainer.optimize)
    for line in (
        "self.adapter.scheduler.train_timesteps",
        "with self.accelerator.accumulate(*self.adapter.trainable_components):",
        "old_log_prob = batch['log_probs'][:, log_probs_index_map[timestep_index]]",
        "latents = batch['all_latents'][:, latents_index_map[timestep_index]]",
        "adv = torch.clamp(adv, adv_clip_range[0], adv_clip_range[1])",
        "clipped_loss = -adv * torch.clamp(ratio, 1.0 + ratio_clip_range[0], 1.0 + ratio_clip_range[1])",
        "policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))",
        "self.accelerator.backward(loss)",
        "with torch.no_grad(), self.adapter.use_ref_parameters():",
        "ref_forward_inputs['return_kwargs'] = ['next_latents_mean']",
        "((output.noise_pred - ref_output.noise_pred) ** 2),",
        "kl_loss = self.training_args.kl_beta * kl_div",
    ):
        assert line in theirs, line
    # the routing TwoExpertAdapter transcribes (and AdapterVelocity declares) is their Wan adapters'
    from flow_factory.models.wan.wan2_t2v import Wan2_T2V_Adapter

    wan = inspect.getsource(Wan2_T2V_Adapter.forward)
    for line in (
        "t = t[0] if t.ndim == 1 else t",
        "boundary_timestep = self.pipeline.config.boundary_ratio * self.scheduler.config.num_train_timesteps",
        "if boundary_timestep is None or t >= boundary_timestep:",
    ):
        assert line in wan, line
