"""JAGG inside your own GRPO loop: a toy velocity model, one group of W SDE steps, exact vs JAGG backward.

Run: python examples/own_trainer.py   (CPU, about a second; only the jagg package and torch)
"""

import torch
from torch import nn

from jagg import GRPOStepLoss, group_advantages, group_backward, sde_step_with_logprob, shifted_linear_sigmas

torch.manual_seed(0)
W, B, D = 4, 8, 16  # steps in the group, trajectories (2 prompts x 4 images), latent size
SDE = dict(kind="flow_grpo", noise_level=0.7)  # Flow-GRPO's SDE step (jagg.engine.sde.SDE_KINDS)


class Velocity(nn.Module):
    """Your model, v(z, t): here an MLP on a flat latent; t is a scalar or one time per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D + 1, 64), nn.Tanh(), nn.Linear(64, D))

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(t, dtype=z.dtype).expand(z.shape[0])
        return self.net(torch.cat([z, t[:, None]], dim=1))


model = Velocity().double()
sigmas = shifted_linear_sigmas(W + 1)  # 1 -> 0 in W + 1 steps; the group is the first W (all stochastic)
with torch.no_grad():  # rollout: W SDE steps from noise, storing each input, next latent and log-prob
    x, steps = [torch.randn(B, D, dtype=torch.float64)], []
    for j in range(W):
        steps.append(sde_step_with_logprob(x[j], model(x[j], sigmas[j]), sigmas[j], sigmas[j + 1], **SDE))
        x.append(steps[-1].prev_sample)
reward = -x[-1].square().mean(dim=1)  # your reward model, one score per image
loss = GRPOStepLoss(  # the per-step GRPO loss: SDE log-prob of the stored next latent, clipped PPO ratio
    x=torch.stack(x[:W]),
    x_next=torch.stack(x[1:]),
    sigma=sigmas[:W],
    sigma_next=sigmas[1 : W + 1],
    old_log_prob=torch.stack([s.log_prob for s in steps]),
    advantages=group_advantages(reward, torch.arange(B) // 4),
    clip_range=1e-4,
    **SDE,
)
grads = {}
for strategy in ("exact", "jagg"):  # the update: one call per group adds the gradient to .grad
    model.zero_grad()
    stats = group_backward(model, loss.x, loss.sigma, loss, strategy)
    grads[strategy] = torch.cat([p.grad.flatten() for p in model.parameters()])
    print(f"{strategy}: {stats.backward_passes} backward passes in {stats.backward_calls} backward call(s)")
cosine = torch.nn.functional.cosine_similarity(grads["exact"], grads["jagg"], dim=0)
print(f"cosine(JAGG, exact) = {cosine:.6f}")
