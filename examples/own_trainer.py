"""Hand a per-step GRPO loop's T backward calls to ONE backward plan.

Engines such as Flow-Factory and verl-omni train each SDE step with its own transformer forward, its own clipped
PPO loss and its own backward (UniRL forwards every step, then runs one backward through all T graphs).
`per_step_backward` below is that loop; `one_plan_backward` gives the same steps to a `BackwardSetting` instead.
What maps to what, and what does not carry over (loss scaling, gradient accumulation, DDP / FSDP reductions), is
in docs/engine.md, "Using the engine from your own trainer".

Run: python examples/own_trainer.py   (CPU, about a second after the imports; jagg, torch and diffusers)
"""

from dataclasses import dataclass

import torch

from jagg import (
    BackwardSetting,
    Knots,
    Routing,
    clipped_ppo_loss,
    group_advantages,
    sde_step_with_logprob,
    shifted_linear_sigmas,
)
from jagg.engine.strategies import StepLoss
from jagg.models import TextCond, build_tiny_backbone

T, B = 6, 4  # trained SDE steps per trajectory, trajectories per micro-batch (2 prompts x 2 images)
SDE = dict(kind="flow_grpo", noise_level=0.7)  # Flow-GRPO's SDE step (jagg.engine.sde.SDE_KINDS)
CLIP = 1e-4  # Flow-GRPO's PPO clip range


@dataclass
class Batch:
    """One micro-batch as a rollout stores it, batch-first like the engines above."""

    latents: torch.Tensor  # (B, T + 1, C, H, W): x_0 .. x_T, the input of step i and its sampled next latent
    sigmas: torch.Tensor  # (T + 1,): step i runs from sigmas[i] to sigmas[i + 1]
    log_probs: torch.Tensor  # (B, T): log-prob of each sampled next latent at sampling time (PPO's "old")
    outputs: torch.Tensor  # (B, T, C, H, W): the model outputs of the rollout (optional; they save forwards)
    advantages: torch.Tensor  # (B,)


def step_loss(batch: Batch, i: int, v: torch.Tensor) -> torch.Tensor:
    """Step i's loss as their loop computes it after the forward: the SDE log-prob of the stored next latent
    under the step driven by v, the PPO ratio to the old log-prob, the clipped surrogate. Divided by T because
    their gradient accumulation counts every step as one micro-step."""
    x, x_next = batch.latents[:, i], batch.latents[:, i + 1]
    step = sde_step_with_logprob(x, v, batch.sigmas[i], batch.sigmas[i + 1], prev_sample=x_next, **SDE)
    loss, _ = clipped_ppo_loss(step.log_prob, batch.log_probs[:, i], batch.advantages, CLIP)
    return loss / T


# --------------------------------------------------------------------------- before: their per-step loop
def per_step_backward(velocity, batch: Batch) -> int:
    """One forward with autograd and one backward per trained step. Returns the backward passes: T."""
    for i in range(T):
        v = velocity(batch.latents[:, i], batch.sigmas[i])
        step_loss(batch, i, v).backward()
    return T


# --------------------------------------------------------------------------- after: one plan
@dataclass
class StepSignals(StepLoss):
    """What ``BackwardSetting.backward`` reads, the ``StepLoss`` protocol: the steps' inputs ``x`` (T, B, ...),
    their times ``sigma`` (T,) and the per-step loss ``loss(i, v)`` as a function of step i's model output (the
    same function as above)."""

    batch: Batch

    def __post_init__(self) -> None:
        self.x = self.batch.latents[:, :T].transpose(0, 1)  # the engine is step-first: (T, B, C, H, W)
        self.sigma = self.batch.sigmas[:T]

    def __call__(self, i: int, v: torch.Tensor) -> torch.Tensor:
        return step_loss(self.batch, i, v)


def one_plan_backward(velocity, batch: Batch, setting: BackwardSetting, stored: bool = True):
    """The same steps as ONE plan: the routing places the knots, every step's signal comes from its stored
    output (valid only until the first optimizer step after the rollout: ``stored=False`` afterwards), and only
    the knots are forwarded with autograd and back-propagated, in one backward call per block."""
    outputs = batch.outputs.transpose(0, 1) if stored else None  # (T, B, C, H, W)
    return setting.backward(velocity, StepSignals(batch), outputs)


# --------------------------------------------------------------------------- a tiny model and a rollout
# the real Flux transformer class with a ~100k-parameter config, in float64 so the comparison is tight
backbone = build_tiny_backbone("flux", seed=0, latent_channels=4).double()
g = torch.Generator().manual_seed(0)
cond = TextCond(  # stands in for the text encoder's output
    embeds=torch.randn(B, 5, 32, generator=g, dtype=torch.float64),
    mask=torch.ones(B, 5, dtype=torch.long),
    pooled=torch.randn(B, 32, generator=g, dtype=torch.float64),
)


def velocity(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """v(z, t) for the micro-batch's conditioning. A stacked knot forward passes k * B rows with one t per row:
    the conditioning is tiled k times, as your forward must do (``Backbone.bind`` does the same)."""
    k = z.shape[0] // B
    tiled = TextCond(
        embeds=cond.embeds.repeat(k, 1, 1), mask=cond.mask.repeat(k, 1), pooled=cond.pooled.repeat(k, 1)
    )
    return backbone.velocity(z, t, tiled)


sigmas = shifted_linear_sigmas(T + 1)[: T + 1]  # T stochastic steps of a (T + 1)-step schedule
with torch.no_grad():  # the rollout: T SDE steps from noise, storing inputs, outputs and log-probs
    x, v, lp = [torch.randn(B, 4, 4, 4, generator=g, dtype=torch.float64)], [], []
    for i in range(T):
        v.append(velocity(x[i], sigmas[i]))
        step = sde_step_with_logprob(x[i], v[i], sigmas[i], sigmas[i + 1], generator=g, **SDE)
        x.append(step.prev_sample)
        lp.append(step.log_prob)
reward = -x[-1].square().flatten(1).mean(dim=1)  # your reward model, one score per image
batch = Batch(
    latents=torch.stack(x, dim=1),
    sigmas=sigmas,
    log_probs=torch.stack(lp, dim=1),
    outputs=torch.stack(v, dim=1),
    advantages=group_advantages(reward, torch.arange(B) // 2),
)


def gradient() -> torch.Tensor:
    """The accumulated .grad, flattened; cleared for the next backward."""
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in backbone.parameters()]
    )
    backbone.zero_grad(set_to_none=True)
    return flat


passes = per_step_backward(velocity, batch)
reference = gradient()
print(f"per-step loop: {passes} backward passes in {passes} backward calls")
settings = {
    "exact": BackwardSetting(routing=Routing.exact()),
    "jagg W=3": BackwardSetting(routing=Routing(strategy="jagg", group_size=3)),  # 2 groups of 3 steps
    "knots K=3": BackwardSetting(routing=Knots(count=3, placement="low_noise")),  # 3 knots shared by 6 steps
}
for name, setting in settings.items():
    stats = one_plan_backward(velocity, batch, setting)
    grad = gradient()
    if name == "exact":  # the same gradient as the loop, to rounding
        rel = ((grad - reference).norm() / reference.norm()).item()
        assert rel < 1e-12, rel
        compare = f"relative difference to the loop {rel:.0e}"
    else:
        compare = f"cosine to the loop {torch.nn.functional.cosine_similarity(grad, reference, dim=0):.4f}"
    counts = f"{stats.backward_passes} backward passes in {stats.backward_calls} backward calls"
    print(f"{name}: {counts}, {compare}")

# The optimizer step: the weights move, so the rollout's stored outputs no longer are the model's outputs. A plan
# that read them now would mix old and new weights: drop them (stored=False) until the next rollout.
optimizer = torch.optim.SGD(backbone.parameters(), lr=1e-2)
one_plan_backward(velocity, batch, settings["knots K=3"])
optimizer.step()
optimizer.zero_grad(set_to_none=True)
with torch.no_grad():
    stale = (velocity(batch.latents[:, 0], sigmas[0]) - batch.outputs[:, 0]).abs().max().item()
stats = one_plan_backward(velocity, batch, settings["knots K=3"], stored=False)
print(
    f"after the optimizer step: stored outputs off by {stale:.1e}, dropped; knots K=3: {stats.backward_passes} backward passes"
)
