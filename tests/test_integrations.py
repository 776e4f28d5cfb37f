"""``backward_fn``: a ``BackwardSetting``'s backward calls go through the caller's function, and with
``jagg.integrations.accelerate_backward`` through accelerate's real ``Accelerator.backward`` (its accumulation
division and loss scaling apply; unscaled, the gradient is the plain one). float64 on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import Steps, grads_of, make_grpo_step_loss, make_model, rel_err, straight_path_latents
from jagg.engine.knots import Knots
from jagg.engine.routing import BackwardSetting, Routing
from jagg.integrations import accelerate_backward

accelerate = pytest.importorskip("accelerate", reason="accelerate (requirements.txt) is not installed")

SIGMAS = torch.tensor([0.95, 0.83, 0.66, 0.52, 0.41, 0.27, 0.15], dtype=torch.float64)
SETTINGS = {
    "exact": BackwardSetting(routing=Routing.exact()),
    "jagg_joint": BackwardSetting(routing=Routing(strategy="jagg", group_size=3), graph_mode="joint"),
    "knots_sequential": BackwardSetting(routing=Knots(count=3, placement="time"), graph_mode="sequential"),
}


def micro_batch(seed=0):
    module, velocity, shape = make_model("mlp", seed=seed)
    t = SIGMAS.shape[0] - 1
    latents = straight_path_latents(shape, SIGMAS[:t], seed=seed + 1)
    loss = make_grpo_step_loss(velocity, latents, SIGMAS[:t], SIGMAS[1:], seed=seed + 2)
    return module, velocity, Steps(latents, SIGMAS[:t], loss)


def gradient(module, setting, velocity, loss):
    module.zero_grad(set_to_none=True)
    stats = setting.backward(velocity, loss)
    return grads_of(module).clone(), stats


@pytest.mark.parametrize("name", SETTINGS)
def test_every_backward_call_goes_through_backward_fn(name):
    module, velocity, loss = micro_batch()
    plain, plain_stats = gradient(module, SETTINGS[name], velocity, loss)
    calls = []

    def spy(tensors, grads):
        calls.append(len(tensors))
        torch.autograd.backward(tensors, grads)

    hooked, stats = gradient(module, dataclasses.replace(SETTINGS[name], backward_fn=spy), velocity, loss)
    assert len(calls) == stats.backward_calls == plain_stats.backward_calls > 0
    assert sum(calls) == stats.backward_graphs
    assert torch.equal(hooked, plain)

    def nothing(tensors, grads):  # a backward_fn that drops the call: no gradient arrives
        pass

    dropped, _ = gradient(module, dataclasses.replace(SETTINGS[name], backward_fn=nothing), velocity, loss)
    assert dropped.abs().max() == 0


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def accelerated(module, **kwargs):
    """accelerate's real Accelerator on the CPU with ``module`` and an SGD optimizer prepared, and a count of
    its ``backward`` calls (the real method runs)."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, **kwargs)
    model, opt = acc.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1))
    calls = []
    real = acc.backward
    acc.backward = lambda loss, **kw: (calls.append(loss.item()), real(loss, **kw))[1]
    return acc, opt, calls


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("accum", [1, 2])
def test_the_gradient_arrives_through_accelerator_backward(name, accum, fresh_accelerate_state):
    module, velocity, loss = micro_batch()
    plain, plain_stats = gradient(module, SETTINGS[name], velocity, loss)
    acc, _, calls = accelerated(module, gradient_accumulation_steps=accum)
    setting = dataclasses.replace(SETTINGS[name], backward_fn=accelerate_backward(acc))
    got, stats = gradient(module, setting, velocity, loss)
    assert len(calls) == stats.backward_calls == plain_stats.backward_calls
    # accelerate divides every loss it back-propagates by gradient_accumulation_steps: proof it went through it
    assert rel_err(got * accum, plain) < 1e-12


@pytest.mark.parametrize("name", SETTINGS)
def test_a_loss_scaled_run_unscales_to_the_plain_gradient(name, fresh_accelerate_state):
    module, velocity, loss = micro_batch()
    plain, _ = gradient(module, SETTINGS[name], velocity, loss)
    acc, opt, calls = accelerated(module)
    # accelerate makes its GradScaler only for fp16 on an accelerator; on the CPU we hand it one (torch's, the
    # class it would make on CUDA) so that Accelerator.backward takes its scaler branch: scaler.scale(loss).backward()
    scale = 2.0**10
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    opt.scaler = acc.scaler
    setting = dataclasses.replace(SETTINGS[name], backward_fn=accelerate_backward(acc))
    module.zero_grad(set_to_none=True)
    setting.backward(velocity, loss)
    assert calls and rel_err(grads_of(module), scale * plain) < 1e-12  # scaled on the way through
    # what Accelerator.unscale_gradients runs under fp16 (it is a no-op on the CPU, where native_amp is off)
    acc.scaler.unscale_(opt.optimizer)
    assert rel_err(grads_of(module), plain) < 1e-12
