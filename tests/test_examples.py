"""examples/own_trainer.py (quoted by the README) runs as a user would run it, and a per-step GRPO loop in the
shape of Flow-Factory / verl-omni / UniRL hands its T backward calls to one plan (docs/engine.md, "Using the
engine from your own trainer")."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch

from helpers import count_passes, grads_of, make_grpo_step_loss, make_model, rel_err, straight_path_latents
from jagg import BackwardSetting, Knots, Routing, clipped_ppo_loss, sde_step_with_logprob

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_trainer.py"
LINE = re.compile(r"(.+): (\d+) backward passes in (\d+) backward calls(?:, (.+))?")


def test_own_trainer_prints_passes_and_the_gradients(capsys):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr  # the example asserts exact == the loop itself
    *lines, after_step = out.stdout.splitlines()
    rows = [LINE.fullmatch(line).groups() for line in lines]
    # after the optimizer step the stored outputs are not the model's any more: the example drops them
    stale = re.fullmatch(
        r"after the optimizer step: stored outputs off by (.+), dropped; knots K=3: 3 backward passes",
        after_step,
    )
    assert stale and float(stale.group(1)) > 0
    assert [(name, int(p), int(c)) for name, p, c, _ in rows] == [
        ("per-step loop", 6, 6),  # T = 6 forward + backward pairs
        ("exact", 6, 6),  # the exact plan is the same loop
        ("jagg W=3", 4, 2),  # two groups, each one backward through its two endpoints
        ("knots K=3", 3, 1),  # three shared knots, one backward
    ]
    assert re.fullmatch(r"relative difference to the loop (.+)", rows[1][3])
    for _, _, _, compare in rows[2:]:  # approximations, not the exact gradient, and not unrelated ones
        cosine = float(re.fullmatch(r"cosine to the loop ([0-9.]+)", compare).group(1))
        assert 0.5 < cosine < 1.0
    # the printed counts are what hooks on the transformer count, and what the cost model predicts
    ns = runpy.run_path(str(EXAMPLE))
    capsys.readouterr()
    backbone, velocity, batch = ns["backbone"], ns["velocity"], ns["batch"]
    with count_passes(backbone) as loop:
        ns["per_step_backward"](velocity, batch)
    assert (loop["backward_graphs"], loop["backward_calls"]) == (6, 6)
    for (name, passes, calls, _), setting in zip(rows[1:], ns["settings"].values()):
        with count_passes(backbone) as counted:
            ns["one_plan_backward"](velocity, batch, setting)
        assert counted["backward_calls"] == int(calls), name
        assert setting.cost(ns["T"], batch=1, stored_outputs=True).backward_passes == int(passes), name
    backbone.zero_grad(set_to_none=True)


def test_the_readme_snippet_is_taken_from_the_example():
    """Every code line of the README's engine snippet (``...`` marks an omission) is a line of the example file,
    so the README shows code that the test above runs."""
    readme = (EXAMPLE.parents[1] / "README.md").read_text()
    section = readme.split("## JAGG in your engine", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    example = {line.rstrip() for line in EXAMPLE.read_text().splitlines()}
    code = [line.rstrip() for line in snippet.splitlines() if line.strip() and line.strip() != "..."]
    assert len(code) >= 10
    assert [line for line in code if line not in example] == []


# --------------------------------------------------------------------------- a per-step loop, and the same loop on one plan
class PerStepGRPO:
    """A per-step GRPO loop in the engines' shape (verl-omni ``_run_forward_backward_batch``, Flow-Factory
    ``GRPOTrainer.optimize``): for each trained step of the micro-batch one forward with autograd, the SDE log-prob
    of the stored next latent, the PPO ratio, the clipped loss scaled by the accumulation, one ``.backward()``.
    The batch is batch-first, as theirs: latents / next_latents (B, T, ...), old_log_probs (B, T)."""

    def __init__(self, velocity, *, clip_range: float = 0.2, loss_scale: float = 1.0) -> None:
        self.velocity, self.clip_range, self.loss_scale = velocity, clip_range, loss_scale

    def step_loss(self, batch: dict, i: int, v: torch.Tensor) -> torch.Tensor:
        x, x_next = batch["latents"][:, i], batch["next_latents"][:, i]
        s, s_next = batch["sigmas"][i], batch["sigmas_next"][i]
        step = sde_step_with_logprob(x, v, s, s_next, kind="flow_grpo", noise_level=0.7, prev_sample=x_next)
        old, adv = batch["old_log_probs"][:, i], batch["advantages"]
        loss, _ = clipped_ppo_loss(step.log_prob, old, adv, self.clip_range)
        return loss * self.loss_scale / batch["latents"].shape[1]  # their accumulation counts every step

    def compute_loss_and_backward(self, batch: dict) -> int:
        steps = batch["latents"].shape[1]
        for i in range(steps):
            v = self.velocity(batch["latents"][:, i], batch["sigmas"][i])
            self.step_loss(batch, i, v).backward()
        return steps


@dataclass
class Signals:
    """What ``BackwardSetting.backward`` reads: inputs x (T, B, ...), times sigma (T,), loss(i, v)."""

    x: torch.Tensor
    sigma: torch.Tensor
    loss: object

    def __call__(self, i: int, v: torch.Tensor) -> torch.Tensor:
        return self.loss(i, v)


class PlanGRPO(PerStepGRPO):
    """The same loop with its backward handed to one plan: the per-step loss is the loop's own, unchanged."""

    def __init__(self, velocity, setting: BackwardSetting, **kw) -> None:
        super().__init__(velocity, **kw)
        self.setting = setting

    def compute_loss_and_backward(self, batch: dict):
        signals = Signals(batch["latents"].transpose(0, 1), batch["sigmas"], partial(self.step_loss, batch))
        outputs = batch.get("outputs")  # the rollout's, batch-first
        stored = None if outputs is None else outputs.transpose(0, 1)
        return self.setting.backward(self.velocity, signals, stored)


# non-uniform times, so the t-weights are not just the step index
SIGMAS = torch.tensor([0.97, 0.9, 0.71, 0.66, 0.43, 0.4, 0.22, 0.1, 0.05], dtype=torch.float64)


def rollout_batch(velocity, latents, sigmas, *, stored: bool, seed: int = 3) -> dict:
    """The batch a rollout hands the loop: step inputs ``latents`` (T, B, ...) at ``sigmas[:T]``, next latents
    sampled from the current model (old log-probs slightly perturbed, so ratios differ from 1), random
    advantages; with ``stored`` the rollout's model outputs too."""
    t = latents.shape[0]
    loss = make_grpo_step_loss(velocity, latents, sigmas[:t], sigmas[1 : t + 1], seed=seed)
    batch = {
        "latents": latents.transpose(0, 1),
        "next_latents": loss.steps.x_next.transpose(0, 1),
        "sigmas": sigmas[:t],
        "sigmas_next": sigmas[1 : t + 1],
        "old_log_probs": loss.steps.old_log_prob.T,
        "advantages": loss.advantages,
    }
    if stored:
        with torch.no_grad():
            batch["outputs"] = torch.stack([velocity(latents[i], sigmas[i]) for i in range(t)], dim=1)
    return batch


def loop_gradient(module, trainer, batch):
    module.zero_grad(set_to_none=True)
    with count_passes(module) as counts:
        result = trainer.compute_loss_and_backward(batch)
    return grads_of(module), counts, result


@pytest.mark.parametrize("name", ["mlp", "flux"])
@pytest.mark.parametrize("stored", [False, True], ids=["forward", "stored"])
def test_a_per_step_loop_on_one_plan_gives_its_gradient(name, stored):
    """(a) exact routing: the plan's gradient is the loop's; (b) JAGG groups of W = 2 are exact too, with half
    the backward calls (a nonlinear model: the equality comes from W = 2, not from the model)."""
    module, velocity, shape = make_model(name)
    latents = torch.randn(4, *shape, dtype=torch.float64)  # T = 4 arbitrary step inputs
    batch = rollout_batch(velocity, latents, SIGMAS, stored=stored)
    g_loop, loop, steps = loop_gradient(module, PerStepGRPO(velocity, loss_scale=1 / 3), batch)
    assert steps == 4 and (loop["backward_graphs"], loop["backward_calls"]) == (4, 4)
    assert g_loop.norm() > 0

    exact = BackwardSetting(routing=Routing(strategy="exact", group_size=2))
    g_exact, counted, stats = loop_gradient(module, PlanGRPO(velocity, exact, loss_scale=1 / 3), batch)
    assert rel_err(g_exact, g_loop) < 1e-12
    assert stats.backward_passes == counted["backward_calls"] == 4

    pairs = BackwardSetting(routing=Routing(strategy="jagg", group_size=2))
    g_pairs, counted, stats = loop_gradient(module, PlanGRPO(velocity, pairs, loss_scale=1 / 3), batch)
    assert rel_err(g_pairs, g_loop) < 1e-12
    assert (stats.backward_passes, stats.backward_calls, counted["backward_calls"]) == (4, 2, 2)
    assert stats.forwards_skipped == 0  # W = 2: every step is an endpoint, no forward to replace


@pytest.mark.parametrize("stored", [False, True], ids=["forward", "stored"])
@pytest.mark.parametrize(
    "routing",
    [Routing(strategy="jagg", group_size=4), Knots(count=4, placement="time")],
    ids=["jagg_W4", "knots_K4"],
)
def test_theorem1_a_per_step_loop_on_fewer_backward_passes(routing, stored):
    """(c) a velocity linear in (z, t), step inputs on one straight path: JAGG groups of W = 4 (and 4 shared
    knots) give the loop's exact gradient; (d) with 4 backward passes for T = 8 steps, as the cost model says.
    The same plan on a nonlinear model is not exact: the equality is Theorem 1's, not the test's."""
    t = 8
    module, velocity, shape = make_model("linear")
    batch = rollout_batch(velocity, straight_path_latents(shape, SIGMAS[:t], seed=7), SIGMAS, stored=stored)
    g_loop, loop, _ = loop_gradient(module, PerStepGRPO(velocity), batch)
    assert loop["backward_calls"] == t

    setting = BackwardSetting(routing=routing)
    g_plan, counted, stats = loop_gradient(module, PlanGRPO(velocity, setting), batch)
    assert rel_err(g_plan, g_loop) < 1e-12
    assert stats.backward_passes == 4 < t
    assert counted["backward_calls"] == stats.backward_calls < t
    assert setting.cost(t, stored_outputs=stored).backward_passes == stats.backward_passes
    assert stats.forwards_skipped == (t - 4 if stored else 0)  # stored outputs replace the non-knot forwards

    module, velocity, shape = make_model("mlp")
    batch = rollout_batch(velocity, straight_path_latents(shape, SIGMAS[:t], seed=7), SIGMAS, stored=stored)
    g_loop, _, _ = loop_gradient(module, PerStepGRPO(velocity), batch)
    g_plan, _, _ = loop_gradient(module, PlanGRPO(velocity, setting), batch)
    assert 1e-6 < rel_err(g_plan, g_loop) < 1.0
