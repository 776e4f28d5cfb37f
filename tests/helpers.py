"""Test helpers: small velocity fields, a GRPO step loss, one group's backward setting, and pass counters."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from jagg.engine.grpo import GRPOStepLoss, TrainedSteps, clipped_ppo_loss, gaussian_mean_kl
from jagg.engine.routing import BackwardSetting, Routing
from jagg.engine.sde import sde_step_with_logprob
from jagg.models import TextCond, build_tiny_backbone


class MLPVelocity(nn.Module):
    """A small nonlinear velocity field v(z, t) on (B, C, H, W) latents."""

    def __init__(self, shape=(2, 4, 4), hidden=32):
        super().__init__()
        d = int(torch.tensor(shape).prod())
        self.shape = shape
        self.net = nn.Sequential(nn.Linear(d + 1, hidden), nn.Tanh(), nn.Linear(hidden, d))

    def forward(self, z, t):
        t = torch.as_tensor(t, dtype=z.dtype).expand(z.shape[0])
        return self.net(torch.cat([z.flatten(1), t[:, None]], dim=1)).view(z.shape)


class LinearVelocity(nn.Module):
    """v(z, t) = A z + b t + c: linear in (z, t), the setting of Theorem 1."""

    def __init__(self, shape=(2, 4, 4)):
        super().__init__()
        d = int(torch.tensor(shape).prod())
        self.A = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.b = nn.Parameter(torch.randn(d))
        self.c = nn.Parameter(torch.randn(d))

    def forward(self, z, t):
        t = torch.as_tensor(t, dtype=z.dtype).expand(z.shape[0])
        return (z.flatten(1) @ self.A.T + t[:, None] * self.b + self.c).view(z.shape)


MODEL_NAMES = ("mlp", "linear", "flux", "qwenimage", "wan")


# diffusers' Wan runs its norms in float32 even in a float64 model (``FP32LayerNorm`` and ``hidden_states.float()``
# in WanTransformerBlock / the output norm), so two float64 computations of the same gradient that group their
# rows differently (a stacked knot forward against one forward per knot) agree to ~1e-9 rather than to 1e-12.
FLOAT32_NORMS = {"wan": 1e-8}


def model_tol(name: str, tol: float) -> float:
    """``tol``, or the floor of a model whose float64 forward rounds through float32 (``FLOAT32_NORMS``)."""
    return max(tol, FLOAT32_NORMS.get(name, 0.0))


def make_model(name: str, batch: int = 2, seed: int = 0):
    """(module, velocity(z, t), latent shape (B, C, H, W); Wan's (B, C, F, H, W)) in float64 for a named test
    model."""
    torch.manual_seed(seed)
    if name in ("mlp", "linear"):
        module = (MLPVelocity if name == "mlp" else LinearVelocity)().double()
        return module, module, (batch, 2, 4, 4)
    backbone = build_tiny_backbone(name, seed=seed, latent_channels=4).double()
    g = torch.Generator().manual_seed(seed + 1)
    cond = TextCond(
        embeds=torch.randn(batch, 5, 32, generator=g, dtype=torch.float64),
        mask=torch.ones(batch, 5, dtype=torch.long),
        pooled=torch.randn(batch, 32, generator=g, dtype=torch.float64),
    )
    return backbone, backbone.bind(cond), (batch, 4, 3, 4, 4) if name == "wan" else (batch, 4, 4, 4)


def straight_path_latents(shape, sigmas, seed=0):
    """Latents of a straight rectified-flow path z_t = (1 - t) x0 + t eps at the given times: (W, B, ...)."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(shape, generator=g, dtype=torch.float64)
    eps = torch.randn(shape, generator=g, dtype=torch.float64)
    return torch.stack([(1 - t) * x0 + t * eps for t in sigmas])


def make_grpo_step_loss(velocity, latents, sigmas, sigma_next, *, kind="flow_grpo", noise=0.7, seed=0):
    """A realistic step loss: ``GRPOStepLoss`` (clipped PPO on the SDE log-prob of a stored next sample).

    The stored samples and old log-probs come from the current model (on-policy), the advantages are
    random; ``step_loss(j, v)`` is a differentiable function of step j's model output only.
    """
    g = torch.Generator().manual_seed(seed)
    w, b = latents.shape[:2]
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    stored, old_lp = [], []
    with torch.no_grad():
        for j in range(w):
            step = sde_step_with_logprob(
                latents[j],
                velocity(latents[j], sigmas[j]),
                sigmas[j],
                sigma_next[j],
                kind=kind,
                noise_level=noise,
                generator=g,
            )
            stored.append(step.prev_sample)
            # perturb the old log-probs a little so that ratios differ from 1 but stay inside the clip
            old_lp.append(step.log_prob + 1e-3 * torch.randn(b, generator=g, dtype=torch.float64))
    return GRPOStepLoss(
        TrainedSteps(
            x=latents,
            x_next=torch.stack(stored),
            sigma=sigmas,
            sigma_next=sigma_next,
            old_log_prob=torch.stack(old_lp),
        ),
        advantages=adv,
        kind=kind,
        noise_level=noise,
        clip_range=0.2,
    )


@dataclass(frozen=True)
class Steps:
    """A plain ``step_loss(j, v)`` of the T steps at ``x`` (T, B, ...) and times ``sigma`` (T,) or (T, B), as the
    loss ``BackwardSetting.backward`` reads (a ``GRPOStepLoss`` is one already)."""

    x: torch.Tensor
    sigma: torch.Tensor
    step_loss: Callable[[int, torch.Tensor], torch.Tensor]

    def __call__(self, j: int, v: torch.Tensor) -> torch.Tensor:
        return self.step_loss(j, v)


def one_group(strategy: str, w: int, **how) -> BackwardSetting:
    """The backward of all ``w`` steps of a micro-batch as one group on ``strategy`` (one step: exact), run
    ``how`` (``BackwardSetting``'s graph_mode, endpoint_signals, ...; its defaults where not given)."""
    return BackwardSetting(routing=Routing(strategy=strategy, group_size=max(w, 2)), **how)


def previous_step_loss(x, x_next, s, s_next, old_lp, adv, a: dict, ref_velocity, scale, log):
    """The per-step loss exactly as ``Trainer._step_loss`` wrote it before ``GRPOStepLoss`` existed: the
    reference the tests hold ``GRPOStepLoss`` to, bit for bit. ``a``: kind, noise_level, clip_range, kl_beta.
    One later change is carried over: the KL divides by Flow-GRPO's ``std_dev_t`` (issue 13) unless
    ``a["kl_std"] == "step"`` (the former ``step.std``)."""

    def step_loss(i, v):
        step = sde_step_with_logprob(
            x[i], v, s[i], s_next[i], kind=a["kind"], noise_level=a["noise_level"], prev_sample=x_next[i]
        )
        loss, stats = clipped_ppo_loss(step.log_prob, old_lp[i], adv, a["clip_range"])
        if ref_velocity is not None:
            with torch.no_grad():
                ref = sde_step_with_logprob(
                    x[i],
                    ref_velocity(x[i], s[i]),
                    s[i],
                    s_next[i],
                    kind=a["kind"],
                    noise_level=a["noise_level"],
                    prev_sample=x_next[i],
                )
            std = step.std_dev_t if a.get("kl_std", "flow_grpo") == "flow_grpo" else step.std
            loss = loss + a["kl_beta"] * gaussian_mean_kl(step.mean, ref.mean, std).mean()
        log.append((loss.item(), stats))
        return loss * scale

    return step_loss


def grads_of(module) -> torch.Tensor:
    """All parameter grads flattened (zeros where None)."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in module.parameters()]
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@contextmanager
def count_passes(module: nn.Module):
    """Count, independently of GroupStats: forwards (with/without grad), backward graphs, backward calls.

    A full backward hook on the model fires once per forward graph that autograd propagates through;
    ``torch.autograd.backward`` is wrapped to count invocations (Tensor.backward goes through it too).
    """
    counts = {"forward": 0, "forward_grad": 0, "backward_graphs": 0, "backward_calls": 0}

    def fwd_hook(mod, args, out):
        counts["forward"] += 1
        counts["forward_grad"] += int(torch.is_grad_enabled())

    def bwd_hook(mod, grad_in, grad_out):
        counts["backward_graphs"] += 1

    real_backward = torch.autograd.backward

    def counting_backward(*args, **kwargs):
        counts["backward_calls"] += 1
        return real_backward(*args, **kwargs)

    module = getattr(module, "transformer", module)  # hook the diffusers model inside an adapter
    # (the hook warns that no *inputs* require grad: expected, latents are data)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    h1 = module.register_forward_hook(fwd_hook)
    h2 = module.register_full_backward_hook(bwd_hook)
    torch.autograd.backward = counting_backward
    try:
        yield counts
    finally:
        torch.autograd.backward = real_backward
        h1.remove()
        h2.remove()


# --------------------------------------------------------------------------- tiny trainers
# The loop tests' run: random-init world backbones scored by JPEG (no `make pretrain`), 2 prompts x 3 images in
# micro-batches of 3 (two optimizer steps per iteration), 6 sampling steps, no evaluation unless asked.
LOOP_RUN = (
    "train.iterations=2",
    "train.prompts_per_iter=2",
    "train.images_per_prompt=3",
    "train.train_batch_size=3",
    "train.grad_accum=1",
    "sampling.num_steps=6",
    "sampling.eval_num_steps=3",
    "log.eval_every=0",
    "log.eval_prompts=4",
    "optim.lr=1e-3",
    "algorithm.clip_range=0.2",
    "algorithm.sde_window_range=[0, 4]",
)


def tiny_config(run_dir, *overrides, config="configs/world/flux_dancegrpo.yaml", base=LOOP_RUN):
    """``load_config(config)`` with ``TINY_OVERRIDES``, ``base`` (default ``LOOP_RUN``), the run directory and
    ``overrides`` (later ones win). Importable by the multi-process workers, which cannot use fixtures."""
    from jagg.config import TINY_OVERRIDES, load_config

    return load_config(config, [*TINY_OVERRIDES, *base, f"log.run_dir={run_dir}", *overrides])


def build_trainer(cfg):
    """The ``Trainer`` of ``cfg`` on its own components, writing to ``cfg.log.run_dir``."""
    from jagg.loop.components import build_components
    from jagg.loop.trainer import Trainer

    return Trainer(cfg, build_components(cfg), cfg.log.run_dir)


# --------------------------------------------------------------------------- paper configs on tiny pipelines
# One iteration of a paper config on a tiny pipeline folder, as a new user runs it through the CLI (the multi-rank
# tests): the recipe's precision, checkpointing and LoRA kept (``TINY_PIPELINE``), 8x8 latents, 4 steps, 2 samples
# in micro-batches of 1, evaluation after the iteration.
PAPER_TINY_RUN = (
    "sampling.latent_size=8",
    "sampling.num_steps=4",
    "sampling.eval_num_steps=2",
    "algorithm.sde_window_range=[0, 3]",
    "train.iterations=1",
    "train.prompts_per_iter=1",
    "train.images_per_prompt=2",
    "train.train_batch_size=1",
    "train.grad_accum=1",
    "log.eval_every=1",
    "log.eval_prompts=2",
)


def paper_tiny_argv(config, pipeline, prompts, run_dir, *extra: str) -> list[str]:
    """The CLI's argv for ``config`` on the tiny pipeline folder ``pipeline`` with ``prompts`` (a file):
    ``tiny_pipeline_overrides``, ``PAPER_TINY_RUN``, the run directory, then ``extra`` (later ones win)."""
    from jagg.config import tiny_pipeline_overrides

    return [
        "--config",
        str(config),
        *tiny_pipeline_overrides(pipeline, prompts),
        *PAPER_TINY_RUN,
        f"log.run_dir={run_dir}",
        *extra,
    ]


class CountingEncoder:
    """Stands in for the text encoders: one random row per prompt, counting the prompts it encodes."""

    def __init__(self) -> None:
        self.encoded = 0

    def encode_prompts(self, prompts):
        from jagg.models import TextCond

        self.encoded += len(prompts)
        return TextCond(embeds=torch.randn(len(prompts), 3, 4), pooled=torch.randn(len(prompts), 4))
