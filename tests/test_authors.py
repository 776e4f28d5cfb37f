"""The JAGG authors' recipe (SchumiDing/eff_grpo, commit ae14d64): the ``jagg_index`` weight rule and the
``contiguous_groups`` step selection, in float64 with tight tolerances.

Invariants: jagg_index == jagg where a group's times are evenly spaced and at W = 2; jagg_index is NOT exact for
a linear velocity on the chord under a shifted schedule while jagg is (Theorem 1 needs the t-weights); our
backward with jagg_index groups and ``graph_mode="sequential"`` without stored outputs equals an
independent re-implementation of the authors' ``grpo_group_backward`` loop (written here from reading
``fastvideo/train_grpo_qwenimage_jagg.py``); contiguous_groups trains whole blocks of W consecutive steps,
drawn from the iteration's generator, and every planned group is one block.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from helpers import (
    Steps,
    grads_of,
    make_grpo_step_loss,
    make_model,
    one_group,
    rel_err,
    straight_path_latents,
)
from jagg.config import AlgorithmConfig, BackwardConfig, load_config
from jagg.engine.algorithms import DanceGRPO
from jagg.engine.grpo import GRPOStepLoss, TrainedSteps
from jagg.engine.routing import BackwardSetting, Routing, plan_groups
from jagg.engine.sde import shifted_linear_sigmas
from jagg.engine.strategies import GRAPH_MODES, jagg_index_weights, jagg_weights
from jagg.errors import ConfigError

AUTHORS = "configs/paper/qwenimage_dancegrpo_authors.yaml"
ETA, CLIP, ADV_CLIP = 0.3, 0.1, 5.0  # run_jagg.sh: --eta 0.3 --clip_range 0.1 --adv_clip_max 5.0


def setup(name, sigmas, *, seed=0, batch=2):
    """A float64 model, latents on a straight path at ``sigmas[:-1]`` and a GRPO step loss of those W steps."""
    module, velocity, shape = make_model(name, batch=batch, seed=seed)
    w = sigmas.shape[0] - 1
    latents = straight_path_latents(shape, sigmas[:w], seed=seed + 7)
    step_loss = make_grpo_step_loss(velocity, latents, sigmas[:w], sigmas[1:], seed=seed + 3)
    return module, velocity, latents, sigmas[:w], step_loss


def grad(strategy, module, velocity, latents, sigmas, step_loss, **how):
    module.zero_grad(set_to_none=True)
    one_group(strategy, latents.shape[0], **how).backward(velocity, Steps(latents, sigmas, step_loss))
    return grads_of(module)


def authors_setting(strategy: str, **how) -> BackwardSetting:
    """Every group of 4 on ``strategy``, the graphs one at a time, no stored outputs (the authors' backward)."""
    routing = Routing(strategy=strategy, group_size=4, jagg_frac=1.0)
    return BackwardSetting(routing=routing, graph_mode="sequential", stored_outputs=False, **how)


# --------------------------------------------------------------------------- the weight rule


def _dance_step_loss(latents, sigmas, old_lp, steps, adv, scale):
    """This repository's per-step DanceGRPO loss on the trained ``steps`` of one authors-style rollout."""
    return GRPOStepLoss(
        TrainedSteps(
            x=latents[steps],
            x_next=latents[steps + 1],
            sigma=sigmas[steps],
            sigma_next=sigmas[steps + 1],
            old_log_prob=old_lp[steps],
        ),
        advantages=adv,
        kind="dance",
        noise_level=ETA,
        clip_range=CLIP,
        scale=scale,
    )


def test_index_weights_are_the_step_index_and_equal_t_weights_on_even_spacing():
    even = torch.linspace(0.9, 0.3, 5, dtype=torch.float64)
    w = jagg_index_weights(even)
    assert w[:, 1].tolist() == [0.0, 0.25, 0.5, 0.75, 1.0] and w[:, 0].tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert torch.allclose(w, jagg_weights(even), rtol=0, atol=1e-15)
    shifted = shifted_linear_sigmas(20, 3.0)[4:9]  # uneven under shift 3
    assert (jagg_index_weights(shifted) - jagg_weights(shifted)).abs().max() > 1e-2
    per_sample = torch.stack([shifted, shifted * 0.5], dim=1)  # (W, B): index weights ignore the times
    assert jagg_index_weights(per_sample).shape == (5, 2, 2)
    assert torch.equal(jagg_index_weights(per_sample)[..., 1], jagg_index_weights(shifted))


@pytest.mark.parametrize("name", ["mlp", "flux"])
@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
def test_jagg_index_equals_jagg_where_the_times_are_evenly_spaced(name, graph_mode):
    sigmas = torch.linspace(
        0.95, 0.35, 5, dtype=torch.float64
    )  # W = 4 steps, evenly spaced, and the next time
    module, velocity, latents, sig, step_loss = setup(name, sigmas)
    g_jagg = grad("jagg", module, velocity, latents, sig, step_loss, graph_mode=graph_mode)
    g_index = grad("jagg_index", module, velocity, latents, sig, step_loss, graph_mode=graph_mode)
    g_exact = grad("exact", module, velocity, latents, sig, step_loss)
    assert g_jagg.norm() > 0 and rel_err(g_jagg, g_exact) > 1e-6  # a real approximation, not exact
    assert rel_err(g_index, g_jagg) < 1e-12


@pytest.mark.parametrize("w", [3, 4, 6])
@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
def test_theorem1_holds_for_t_weights_and_fails_for_index_weights_under_a_shifted_schedule(w, graph_mode):
    """Linear velocity, latents on the chord: jagg is exact; with shift 3 the times of a group are uneven, so
    alpha_j = j / (W - 1) puts the intermediate signals at the wrong point of the chord."""
    sigmas = shifted_linear_sigmas(20, 3.0)[2 : w + 3]  # W steps of the authors' schedule and the next time
    module, velocity, latents, sig, step_loss = setup("linear", sigmas)
    g_exact = grad("exact", module, velocity, latents, sig, step_loss)
    g_jagg = grad("jagg", module, velocity, latents, sig, step_loss, graph_mode=graph_mode)
    g_index = grad("jagg_index", module, velocity, latents, sig, step_loss, graph_mode=graph_mode)
    assert rel_err(g_jagg, g_exact) < 1e-10
    assert rel_err(g_index, g_exact) > 1e-4


@pytest.mark.parametrize("name", ["mlp", "linear", "qwenimage"])
@pytest.mark.parametrize("graph_mode", GRAPH_MODES)
def test_jagg_index_is_exact_at_w2_for_any_model(name, graph_mode):
    sigmas = shifted_linear_sigmas(20, 3.0)[5:8]
    module, velocity, latents, sig, step_loss = setup(name, sigmas)
    g_exact = grad("exact", module, velocity, latents, sig, step_loss)
    assert (
        rel_err(grad("jagg_index", module, velocity, latents, sig, step_loss, graph_mode=graph_mode), g_exact)
        < 1e-10
    )


def test_jagg_index_with_per_sample_times_matches_separate_calls():
    """sigmas (W, B): each sample's group backward is the same as running it alone."""
    module, velocity, _, _, _ = setup("mlp", shifted_linear_sigmas(4, 3.0))
    sig = torch.tensor([[0.9, 0.8], [0.6, 0.75], [0.5, 0.4], [0.2, 0.3]], dtype=torch.float64)  # (W, B)
    x0, eps = torch.randn(2, 2, 4, 4, dtype=torch.float64), torch.randn(2, 2, 4, 4, dtype=torch.float64)
    latents = torch.stack([(1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps for s in sig])
    target = torch.randn_like(latents)
    g_batch = grad("jagg_index", module, velocity, latents, sig, lambda j, v: ((v - target[j]) ** 2).mean())
    module.zero_grad(set_to_none=True)
    for i in range(2):
        loss_i = Steps(
            latents[:, i : i + 1], sig[:, i], lambda j, v, i=i: ((v - target[j, i : i + 1]) ** 2).mean() / 2
        )
        one_group("jagg_index", 4, graph_mode="sequential").backward(velocity, loss_i)
    assert g_batch.norm() > 0 and rel_err(grads_of(module), g_batch) < 1e-12


# --------------------------------------------------------------------------- the authors' group backward
def authors_log_prob(v, z, sigmas, i, z_next):
    """``flux_step(..., grpo=True, sde_solver=True)`` with a given next sample: the log-prob of z_next, written
    in the authors' form (Euler mean + score correction, std eta sqrt(sigma_i - sigma_{i+1}))."""
    sigma, dsigma = sigmas[i], sigmas[i + 1] - sigmas[i]
    x0 = z - sigma * v
    score = -(z - x0 * (1 - sigma)) / sigma**2
    mean = z + dsigma * v - 0.5 * ETA**2 * score * dsigma
    std = ETA * math.sqrt(float(sigmas[i] - sigmas[i + 1]))
    log_prob = -((z_next - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def authors_group_backward(velocity, latents, sigmas, steps, old_log_probs, adv, norm):
    """``grpo_group_backward`` as read: W forwards without autograd at the current weights, each step's PPO
    loss differentiated through a detached proxy of its output, alpha_j = j / (W - 1), then two separate
    forward + backward calls, at the first and at the last step. ``latents`` (S + 1, 1, ...) is one sample's
    rollout; ``steps`` the group's W step indices."""
    w = len(steps)
    signals = []
    for i in steps:
        with torch.no_grad():
            v = velocity(latents[i], sigmas[i])
        proxy = v.detach().requires_grad_(True)
        ratio = torch.exp(authors_log_prob(proxy, latents[i], sigmas, i, latents[i + 1]) - old_log_probs[i])
        loss = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP))) / norm
        signals.append(torch.autograd.grad(loss, proxy)[0])
    alpha = torch.linspace(0.0, 1.0, w, dtype=torch.float64)
    s_base = sum((1 - a) * s for a, s in zip(alpha, signals))
    s_corr = sum(a * s for a, s in zip(alpha, signals))
    velocity(latents[steps[0]], sigmas[steps[0]]).backward(s_base)
    velocity(latents[steps[-1]], sigmas[steps[-1]]).backward(s_corr)


def authors_rollout(velocity, sigmas, shape, seed):
    """``run_sample_step``: all S steps SDE from one noise; the latents (S + 1, ...) and log-probs (S, ...)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    latents, log_probs = [z], []
    with torch.no_grad():
        for i in range(sigmas.shape[0] - 1):
            v = velocity(z, sigmas[i])
            std = ETA * math.sqrt(float(sigmas[i] - sigmas[i + 1]))
            x0 = z - sigmas[i] * v
            score = -(z - x0 * (1 - sigmas[i])) / sigmas[i] ** 2
            dsigma = sigmas[i + 1] - sigmas[i]
            z_next = (
                z
                + dsigma * v
                - 0.5 * ETA**2 * score * dsigma
                + std * torch.randn(z.shape, generator=g, dtype=torch.float64)
            )
            log_probs.append(authors_log_prob(v, z, sigmas, i, z_next))
            latents.append(z := z_next)
    return torch.stack(latents), torch.stack(log_probs)


@pytest.mark.parametrize("name", ["mlp", "qwenimage"])
def test_our_sequential_jagg_index_equals_the_authors_group_backward(name):
    """One sample of the authors' recipe: 21 steps (shift 3, eta 0.3), 3 random blocks of 4 of the first 20,
    weights moved off the rollout's (as after an optimizer step, so the PPO ratios are not 1), loss scale
    1 / (grad_accum * 12). Ours: DanceGRPO(contiguous_groups) picks the steps, ``BackwardSetting.backward``
    (jagg_index, sequential, no stored outputs) runs them through ``GRPOStepLoss``. Equal to ~1e-12."""
    module, velocity, shape = make_model(name, batch=1, seed=1)
    sigmas = shifted_linear_sigmas(21, 3.0)
    latents, old_lp = authors_rollout(velocity, sigmas, shape, seed=5)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    algo = DanceGRPO(
        AlgorithmConfig(timestep_fraction=0.6, step_selection="contiguous_groups"),
        BackwardConfig(strategy="jagg_index", group_size=4),
    )
    steps = algo.trained_steps(algo.step_kinds(21, torch.Generator()), 1, torch.Generator().manual_seed(3))[0]
    assert steps.numel() == 12
    adv = torch.tensor([2.7], dtype=torch.float64).clamp(-ADV_CLIP, ADV_CLIP)
    grad_accum = 8
    loss = _dance_step_loss(latents, sigmas, old_lp, steps, adv, scale=1 / (grad_accum * 12))
    module.zero_grad(set_to_none=True)
    stats = authors_setting("jagg_index").backward(velocity, loss)
    ours = grads_of(module)
    assert stats.backward_calls == 6 and stats.strategy == "jagg_index"
    module.zero_grad(set_to_none=True)
    blocks = sorted({int(i) // 4 for i in steps})
    for b in reversed(blocks):  # the authors visit the blocks in a random order; the sum does not care
        authors_group_backward(
            velocity, latents, sigmas, list(range(4 * b, 4 * b + 4)), old_lp, adv, grad_accum * 12
        )
    theirs = grads_of(module)
    i = int(steps[0])
    with torch.no_grad():
        ratio = torch.exp(
            authors_log_prob(velocity(latents[i], sigmas[i]), latents[i], sigmas, i, latents[i + 1])
        )
    assert (ratio / torch.exp(old_lp[i]) - 1).abs().max() > 1e-6  # off-policy: the ratio is not trivially 1
    # the comparison tells the weight rules apart: the t-weights give another gradient on this schedule
    module.zero_grad(set_to_none=True)
    authors_setting("jagg").backward(velocity, loss)
    assert rel_err(grads_of(module), theirs) > 1e-4
    assert theirs.norm() > 0 and rel_err(ours, theirs) < 1e-12


# --------------------------------------------------------------------------- contiguous groups
def dance(fraction=0.6, w=4, strategy="jagg_index", selection="contiguous_groups", exact_steps="structure"):
    return DanceGRPO(
        AlgorithmConfig(timestep_fraction=fraction, step_selection=selection, exact_steps=exact_steps),
        BackwardConfig(strategy=strategy, group_size=w),
    )


@pytest.mark.parametrize(
    ("num_steps", "w", "fraction", "blocks"), [(21, 4, 0.6, 3), (21, 5, 0.6, 2), (13, 3, 1.0, 4)]
)
def test_contiguous_groups_trains_whole_blocks_sorted_by_time(num_steps, w, fraction, blocks):
    algo = dance(fraction, w)
    kinds = algo.step_kinds(num_steps, torch.Generator())
    steps = algo.trained_steps(kinds, 64, torch.Generator().manual_seed(0))
    assert steps.shape == (64, blocks * w)
    starts = steps[:, ::w]
    assert torch.all(starts % w == 0)  # every block starts on the grid of W
    assert torch.equal(steps, (starts[:, :, None] + torch.arange(w)).flatten(1))  # W consecutive steps each
    assert torch.all(steps[:, 1:] > steps[:, :-1])  # sorted by time
    assert steps.max() < num_steps - 1  # the last (deterministic) step is never trained
    n_blocks = (num_steps - 1) // w
    distinct = len({tuple(s.tolist()) for s in starts})
    assert distinct > 1 if blocks < n_blocks else distinct == 1  # random per sample unless all are trained
    assert torch.bincount((starts // w).flatten(), minlength=n_blocks).min() > 0  # every block gets trained


def test_every_planned_group_is_one_block_of_w_consecutive_trajectory_steps():
    """plan_groups cuts the T = k W sorted trained steps into groups of W: each group is one whole block."""
    algo = dance()
    steps = algo.trained_steps(algo.step_kinds(21, torch.Generator()), 32, torch.Generator().manual_seed(1))
    for row in steps:
        for plan in plan_groups(row.numel(), 4, 1.0, "jagg_index"):
            block = row[list(plan.steps)]
            assert plan.strategy == "jagg_index" and block.numel() == 4
            assert int(block[0]) % 4 == 0 and torch.equal(block, block[0] + torch.arange(4))


def test_step_draws_are_deterministic_in_the_generator():
    algo = dance()
    kinds = algo.step_kinds(21, torch.Generator())
    a, b = (algo.trained_steps(kinds, 8, torch.Generator().manual_seed(7)) for _ in range(2))
    c = algo.trained_steps(kinds, 8, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sorted_subset_draws_are_unchanged():
    """The default reading keeps its draws bit for bit (resumed runs and cached results stay valid)."""
    algo = dance(selection="sorted_subset")
    kinds = algo.step_kinds(21, torch.Generator())
    gen, ref = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    expected = torch.stack([torch.randperm(20, generator=ref)[:12].sort().values for _ in range(5)])
    assert torch.equal(algo.trained_steps(kinds, 5, gen), expected)


def test_authors_exact_baseline_of_contiguous_groups_trains_as_many_random_single_steps():
    """exact_steps=random_singles: int(n_blocks * fraction) * W single steps at random (the authors' per-step
    path, which trains int(20 * 0.6) = 12 random steps of 20: the same count here)."""
    algo = dance(strategy="exact", exact_steps="random_singles")
    steps = algo.trained_steps(algo.step_kinds(21, torch.Generator()), 256, torch.Generator().manual_seed(2))
    assert steps.shape == (256, 12)
    assert torch.all(steps[:, 1:] > steps[:, :-1]) and steps.max() < 20
    blockwise = [
        torch.equal(s, (s[::4, None] + torch.arange(4)).flatten()) and bool((s[::4] % 4 == 0).all())
        for s in steps
    ]
    assert sum(blockwise) < 5  # whole blocks only by chance (probability 10 / C(20, 12) per sample)
    assert dance(0.5, 4, "exact", exact_steps="random_singles").trained_steps(
        algo.step_kinds(21, torch.Generator()), 1, torch.Generator()
    ).shape == (1, 8)


@pytest.mark.parametrize("strategy", ["exact", "jagg", "knots"])
def test_every_strategy_trains_the_same_blocks_by_default(strategy):
    """exact_steps=structure (the default): exact trains the blocks every other strategy trains, draw for draw,
    so exact is the gradient reference of those blocks; the authors' baseline does not."""
    kinds = dance().step_kinds(21, torch.Generator())
    draw = lambda algo: algo.trained_steps(kinds, 16, torch.Generator().manual_seed(3))  # noqa: E731
    assert torch.equal(draw(dance(strategy=strategy)), draw(dance()))
    assert not torch.equal(draw(dance(strategy="exact", exact_steps="random_singles")), draw(dance()))


def test_trainer_draws_the_blocks_from_the_iterations_generator(tmp_path):
    """The trainer's rollout of iteration it picks the same blocks every time (resume), other ones at it + 1."""
    from jagg.config import TINY_RUN
    from jagg.loop.components import build_components
    from jagg.loop.trainer import Trainer

    cfg = load_config("configs/world/flux_dancegrpo_authors.yaml", [*TINY_RUN, f"log.run_dir={tmp_path}"])
    trainer = Trainer(cfg, build_components(cfg), cfg.log.run_dir)
    first, again, second = (trainer.rollout(it).trained for it in (0, 0, 1))
    assert first.shape == (4, 12) and torch.equal(first, again) and not torch.equal(first, second)
    assert torch.equal(first, (first[:, ::4, None] + torch.arange(4)).flatten(1))
    assert torch.all(first[:, ::4] % 4 == 0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["sampling.num_steps=20"], r"sampling.num_steps - 1 = 19 .* backward.group_size = 4"),
        (
            ["backward.group_size=auto", "backward.jagg_frac=auto"],
            r"step_selection=contiguous_groups .* 'auto'",
        ),
        (["algorithm.timestep_fraction=0.1"], r"algorithm.timestep_fraction=0.1 trains no block of 5"),
        (["algorithm.step_selection=blocks"], r"algorithm.step_selection must be one of"),
        (["algorithm.name=flowgrpo_fast"], r"applies to algorithm.name=dancegrpo only"),
    ],
)
def test_contiguous_groups_is_validated(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(AUTHORS, overrides)


def test_authors_config_follows_run_jagg_sh():
    cfg = load_config(AUTHORS)
    a, b, o, t = cfg.algorithm, cfg.backward, cfg.optim, cfg.train
    assert (cfg.sampling.num_steps, cfg.sampling.shift, a.noise_level, cfg.model.true_cfg_scale) == (
        21,
        3.0,
        0.3,
        1,
    )
    assert (a.step_selection, a.timestep_fraction, a.clip_range, a.adv_clip, a.init_same_noise) == (
        "contiguous_groups",
        0.6,
        0.1,
        5.0,
        True,
    )
    assert (b.strategy, b.group_size, b.jagg_frac, b.graph_mode, b.stored_outputs) == (
        "jagg_index",
        4,
        1.0,
        "sequential",
        False,
    )
    assert b.endpoint_signals == "nograd"  # W + 2 forwards per group, as grpo_group_backward
    assert (o.lr, o.max_grad_norm, o.weight_decay, t.precision, cfg.model.gradient_checkpointing) == (
        1e-5,
        10.0,
        1e-4,
        "bf16",
        True,
    )
    per_rank = (
        t.prompts_per_iter * t.images_per_prompt // 8
    )  # 8 prompts x 12 per rank, a step every 8 samples
    assert (t.images_per_prompt, per_rank, t.train_batch_size * t.grad_accum) == (12, 96, 8)
    for world in ("flux", "qwenimage"):
        w = load_config(f"configs/world/{world}_dancegrpo_authors.yaml")
        assert (w.sampling.num_steps, w.backward.group_size, w.algorithm.noise_level) == (21, 4, 0.3)
        assert (w.backward.strategy, w.backward.graph_mode, w.algorithm.step_selection) == (
            "jagg_index",
            "sequential",
            "contiguous_groups",
        )
        assert w.model.backbone == world and w.model.gradient_checkpointing and not w.backward.stored_outputs


def test_algorithm_without_backward_config_refuses_contiguous_groups():
    with pytest.raises(ConfigError, match="backward.group_size"):
        DanceGRPO.validate(SimpleNamespace(step_selection="contiguous_groups", timestep_fraction=0.6), 21)


def test_nograd_endpoint_signals_run_the_authors_forward_count():
    """``endpoint_signals="nograd"`` (configs/paper/qwenimage_dancegrpo_authors.yaml) runs the model as often
    as ``authors_group_backward`` does: W forwards without autograd, then 2 with it, per group (W + 2 = 6 for
    W = 4); the default (signals from the graphs) runs W. Same gradient to ~1e-12."""
    module, velocity, shape = make_model("mlp", batch=1, seed=4)
    sigmas = shifted_linear_sigmas(21, 3.0)
    latents, old_lp = authors_rollout(velocity, sigmas, shape, seed=2)
    calls = []

    def counted(z, t):
        calls.append(torch.is_grad_enabled())
        return velocity(z, t)

    steps = torch.arange(4, 8)
    adv = torch.tensor([1.3], dtype=torch.float64)
    loss = _dance_step_loss(latents, sigmas, old_lp, steps, adv, scale=1 / 4)
    module.zero_grad(set_to_none=True)
    authors_group_backward(counted, latents, sigmas, list(range(4, 8)), old_lp, adv, 4)
    theirs, their_calls = grads_of(module), list(calls)
    counts = {}
    for signals in ("graph", "nograd"):
        calls.clear()
        module.zero_grad(set_to_none=True)
        stats = authors_setting("jagg_index", endpoint_signals=signals).backward(counted, loss)
        counts[signals] = (len(calls), sum(calls), stats.forward_passes)
        assert rel_err(grads_of(module), theirs) < 1e-12
    assert (len(their_calls), sum(their_calls)) == (6, 2)
    assert counts == {"graph": (4, 2, 4), "nograd": (6, 2, 6)}
