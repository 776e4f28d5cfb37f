"""MixGRPO (Tencent-Hunyuan/MixGRPO, commit e5cdd6a): the window schedule, the SDE step, the rollout and the loss
against an independent port of their code, in float64.

The port below is written here from reading their ``fastvideo/utils/grpo_states.py`` (``GRPOTrainingStates``),
``fastvideo/utils/sampling_utils.py`` (``flow_grpo_step``, ``run_sample_step`` with ``dpm_algorithm_type="null"``)
and ``fastvideo/train_grpo_flux.py`` (``main``'s window loop, ``train_one_step``'s per-step PPO loss); it calls
none of this repository's code. Invariants: our window at every iteration is their ``get_current_timesteps()``
(except their empty window at start S - 2, where ours is the window at 0); our rollout's latents and log-probs,
and our exact gradient of the window, equal theirs to ~1e-12; with JAGG the window of 4 is one group of 2
backward passes; every draw of iteration ``it`` depends on (seed, it) only.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import build_trainer, grads_of, make_model, rel_err, tiny_config
from jagg.config import AlgorithmConfig, load_config
from jagg.engine.algorithms import ALGORITHMS, MixGRPO
from jagg.engine.grpo import GRPOStepLoss, TrainedSteps
from jagg.engine.routing import BackwardSetting, Routing, plan_groups
from jagg.engine.sampling import sample_trajectory
from jagg.engine.sde import sde_step_with_logprob, shifted_linear_sigmas
from jagg.errors import ConfigError
from jagg.train import main

WORLD = ("configs/world/flux_mixgrpo.yaml", "configs/world/qwenimage_mixgrpo.yaml")
PAPER = ("configs/paper/flux_mixgrpo.yaml", "configs/paper/qwenimage_mixgrpo.yaml")
ETA, CLIP, ADV_CLIP = (
    0.7,
    1e-4,
    5.0,
)  # finetune_flux_grpo_MixGRPO.sh: --eta 0.7 --clip_range 1e-4 --adv_clip_max 5.0


# --------------------------------------------------------------------------- port: grpo_states.py
class TheirStates:
    """``GRPOTrainingStates`` as read (progressive / random / decay / exp_decay, prog_overlap, roll_back)."""

    def __init__(self, iters_per_group, group_size, max_timesteps, sample_strategy="progressive", **kw):
        self.iters_per_group, self.group_size, self.max_timesteps = iters_per_group, group_size, max_timesteps
        self.sample_strategy = sample_strategy
        self.cur_timestep, self.cur_iter_in_group = 0, 0
        self.prog_overlap = kw.get("prog_overlap", True)
        self.prog_overlap_step = kw.get("prog_overlap_step", 1)
        self.max_iters_per_group = kw.get("max_iters_per_group", 10)
        self.min_iters_per_group = kw.get("min_iters_per_group", 1)
        self.roll_back = True
        self.exp_decay_thre_timestep = kw.get("exp_decay_thre_timestep", 13)
        self.exp_decay_k = kw.get("exp_decay_k", 0.1)
        self.init_timestep = self.cur_timestep

    def get_dynamic_iters_per_group(self):
        if self.sample_strategy != "decay":
            return self.iters_per_group
        progress = self.cur_timestep / self.max_timesteps
        current_iters = int(self.max_iters_per_group * (1 - progress) + self.min_iters_per_group * progress)
        return max(self.min_iters_per_group, current_iters)

    def get_exp_decay_iters_per_group(self):
        if self.sample_strategy != "exp_decay":
            return self.iters_per_group
        relu_value = max(0, self.cur_timestep - self.exp_decay_thre_timestep)
        return np.ceil(self.iters_per_group * np.exp(-self.exp_decay_k * relu_value))

    def _advance(self, current_iters):
        self.cur_iter_in_group += 1
        if self.cur_iter_in_group >= current_iters:
            self.cur_iter_in_group = 0
            self.cur_timestep += self.prog_overlap_step if self.prog_overlap else self.group_size
        if self.cur_timestep > self.max_timesteps:
            self.cur_timestep, self.cur_iter_in_group = self.init_timestep, 0  # roll_back_start

    def update_iteration(self, seed=None):
        if self.sample_strategy == "progressive":
            self._advance(self.iters_per_group)
        elif self.sample_strategy == "random":
            rng = np.random.default_rng(seed)
            self.cur_timestep = rng.integers(0, self.max_timesteps - self.group_size + 1)
        elif self.sample_strategy == "decay":
            self._advance(self.get_dynamic_iters_per_group())
        elif self.sample_strategy == "exp_decay":
            self._advance(self.get_exp_decay_iters_per_group())

    def get_current_timesteps(self):
        return list(range(self.cur_timestep, min(self.cur_timestep + self.group_size, self.max_timesteps)))


def their_windows(num_steps, iterations, **kw):
    """``main``: ``max_timesteps = sampling_steps - 2``; each iteration reads the window, then updates."""
    states = TheirStates(max_timesteps=num_steps - 2, **kw)
    out = []
    for _ in range(iterations):
        out.append(states.get_current_timesteps())
        states.update_iteration()
    return out


def mix(num_steps=25, **kw) -> MixGRPO:
    cfg = AlgorithmConfig(name="mixgrpo", sde_kind="flow_grpo", noise_level=ETA, **kw)
    MixGRPO.validate(cfg, num_steps)
    return MixGRPO(cfg)


def our_windows(algo, num_steps, iterations, seed=0):
    return [
        list(algo.window(it, num_steps, torch.Generator().manual_seed(seed + it))) for it in range(iterations)
    ]


# --------------------------------------------------------------------------- the window schedule
SCHEDULES = [
    # (S, their kwargs): the published MixGRPO (25, W 4, 25 per position, step 1) and MixGRPO-Flash* (step 0)
    (25, dict(iters_per_group=25, group_size=4, prog_overlap_step=1)),
    (25, dict(iters_per_group=20, group_size=4, prog_overlap_step=0)),
    (10, dict(iters_per_group=3, group_size=4, prog_overlap_step=1)),
    (10, dict(iters_per_group=2, group_size=3, prog_overlap_step=2)),
    (12, dict(iters_per_group=1, group_size=4, prog_overlap=False)),  # no overlap: move by the window size
    (10, dict(iters_per_group=2, group_size=4, sample_strategy="decay", max_iters_per_group=6)),
    (25, dict(iters_per_group=5, group_size=4, sample_strategy="decay")),
    (25, dict(iters_per_group=5, group_size=4, sample_strategy="exp_decay")),
    (
        20,
        dict(
            iters_per_group=4,
            group_size=2,
            sample_strategy="exp_decay",
            exp_decay_thre_timestep=3,
            exp_decay_k=0.7,
        ),
    ),
]


def _ours_kw(kw: dict) -> dict:
    kw = dict(kw)
    if kw.pop("prog_overlap", True) is False:
        kw["prog_overlap_step"] = kw["group_size"]
    return kw


@pytest.mark.parametrize(("num_steps", "kw"), SCHEDULES)
def test_window_follows_their_training_states_at_every_iteration(num_steps, kw):
    iterations = 800
    theirs = their_windows(num_steps, iterations, **kw)
    ours = our_windows(mix(num_steps, **_ours_kw(kw)), num_steps, iterations)
    first = list(range(0, min(kw["group_size"], num_steps - 2)))
    empty = [it for it, w in enumerate(theirs) if not w]
    for it in range(iterations):
        assert ours[it] == (theirs[it] or first), it  # their empty window (start S - 2) -> the window at 0
    if kw.get("prog_overlap_step", 1) == 0:
        assert all(w == first for w in theirs)  # MixGRPO-Flash*: the window never moves
    # the schedule does roll back, truncates near the end and (for step 1) reaches the empty position
    starts = [w[0] for w in theirs if w]
    if kw.get("prog_overlap_step", 1) > 0:
        assert max(starts) >= num_steps - 2 - kw["group_size"] and starts.count(0) > 1
    if kw.get("prog_overlap_step", 1) == 1 and kw.get("prog_overlap", True):
        assert empty and min(len(w) for w in theirs if w) == 1


def test_published_schedule_sweeps_starts_0_to_11_in_300_iterations():
    """finetune_flux_grpo_MixGRPO.sh: 25 steps, W 4, 25 iterations per position, step 1, 300 iterations."""
    algo = mix(25, group_size=4, iters_per_group=25, prog_overlap_step=1)
    windows = our_windows(algo, 25, 300)
    assert windows == their_windows(25, 300, iters_per_group=25, group_size=4, prog_overlap_step=1)
    assert [w[0] for w in windows[::25]] == list(range(12)) and all(len(w) == 4 for w in windows)


def test_random_schedule_stays_inside_and_is_a_function_of_the_iteration():
    algo = mix(25, sample_strategy="random")
    windows = our_windows(algo, 25, 400)
    assert windows[0] == [0, 1, 2, 3]  # their first window is read before the first update
    starts = [w[0] for w in windows[1:]]
    assert all(len(w) == 4 and w == list(range(w[0], w[0] + 4)) for w in windows)
    assert min(starts) == 0 and max(starts) == 25 - 2 - 4  # rng.integers(0, max_timesteps - group_size + 1)
    assert windows == our_windows(algo, 25, 400) and windows != our_windows(algo, 25, 400, seed=1)
    # theirs: the same range (their draws come from an unseeded generator, so only the range can agree)
    theirs = their_windows(25, 400, iters_per_group=25, group_size=4, sample_strategy="random")
    assert {w[0] for w in theirs[1:]} <= set(range(0, 20)) and theirs[0] == [0, 1, 2, 3]


@pytest.mark.parametrize("it", [0, 24, 25, 299, 575])
def test_step_kinds_sde_on_the_window_ode_elsewhere_and_the_window_trained_in_order(it):
    algo = mix(25)
    gen = torch.Generator().manual_seed(it)
    kinds = algo.step_kinds(25, gen, iteration=it)
    win = their_windows(25, it + 1, iters_per_group=25, group_size=4)[it] or [0, 1, 2, 3]
    assert [i for i, k in enumerate(kinds) if k != "ode"] == win
    assert all(kinds[i] == "flow_grpo" for i in win) and kinds[-1] == "ode"
    steps = algo.trained_steps(kinds, 3, gen)
    assert steps.tolist() == [win] * 3


@pytest.mark.parametrize("name", ["dancegrpo", "flowgrpo", "flowgrpo_fast"])
def test_other_algorithms_ignore_the_iteration(name):
    cfg = AlgorithmConfig(name=name, sde_window_range=[0, 5])
    algo = ALGORITHMS[name](cfg)
    a = algo.step_kinds(10, torch.Generator().manual_seed(3))
    for it in (0, 7, 1000):
        assert algo.step_kinds(10, torch.Generator().manual_seed(3), iteration=it) == a


# --------------------------------------------------------------------------- port: sampling_utils.py
def their_flow_grpo_step(model_output, latents, eta, sigmas, index, prev_sample, noise, determistic=False):
    """``flow_grpo_step`` as read, with ``randn_tensor`` replaced by the given ``noise`` (drawn on every call)."""
    sigma = sigmas[index]
    sigma_prev = sigmas[index + 1]
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    prev_sample_mean = (
        latents * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    if prev_sample is None:
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * noise
    if determistic:
        prev_sample = latents + dt * model_output
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi, dtype=torch.float64)))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean


def their_rollout(velocity, z, sigma_schedule, determistic, gen):
    """``run_sample_step`` with ``dpm_algorithm_type="null"`` and ``--flow_grpo_sampling``."""
    all_latents, all_log_probs = [z], []
    with torch.no_grad():
        for i in range(sigma_schedule.shape[0] - 1):
            pred = velocity(z, sigma_schedule[i])
            noise = torch.randn(z.shape, generator=gen, dtype=torch.float64)
            z, log_prob, _ = their_flow_grpo_step(
                pred, z, ETA, sigma_schedule, i, None, noise, determistic[i]
            )
            all_latents.append(z)
            all_log_probs.append(log_prob)
    return torch.stack(all_latents), torch.stack(all_log_probs)


@pytest.mark.parametrize("index", [0, 1, 7, 22])
def test_flow_grpo_step_equals_theirs(index):
    sigmas = shifted_linear_sigmas(25, 3.0)
    g = torch.Generator().manual_seed(index)
    x, v, noise = (torch.randn(2, 4, 6, 6, generator=g, dtype=torch.float64) for _ in range(3))
    their_sample, their_lp, their_mean = their_flow_grpo_step(v, x, ETA, sigmas, index, None, noise)
    ours = sde_step_with_logprob(x, v, sigmas[index], sigmas[index + 1], kind="flow_grpo", noise_level=ETA)
    assert rel_err(ours.mean, their_mean) < 1e-14
    std = float(ours.std)
    assert rel_err(ours.mean + std * noise, their_sample) < 1e-14
    stored = sde_step_with_logprob(
        x, v, sigmas[index], sigmas[index + 1], kind="flow_grpo", noise_level=ETA, prev_sample=their_sample
    )
    assert torch.allclose(stored.log_prob, their_lp, rtol=1e-13, atol=1e-13)
    # their deterministic step: the Euler ODE step
    ode_sample, _, _ = their_flow_grpo_step(v, x, ETA, sigmas, index, None, noise, determistic=True)
    ode = sde_step_with_logprob(x, v, sigmas[index], sigmas[index + 1], kind="ode", noise_level=ETA)
    assert rel_err(ode.prev_sample, ode_sample) < 1e-15


@pytest.mark.parametrize("it", [0, 130, 575])
def test_rollout_equals_their_mixed_ode_sde_sampling(it):
    """``sample_trajectory`` on MixGRPO's kinds = ``run_sample_step`` on their ``determistic`` list: same latents and
    log-probs at every step (both draw one noise per step, deterministic steps included)."""
    _, velocity, shape = make_model("flux", batch=2, seed=1)
    sigmas = shifted_linear_sigmas(25, 3.0)
    algo = mix(25)
    kinds = algo.step_kinds(25, torch.Generator(), iteration=it)
    window = their_windows(25, it + 1, iters_per_group=25, group_size=4)[it] or [0, 1, 2, 3]
    determistic = [i not in window for i in range(25)]
    z = torch.randn(shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    lat, lp = their_rollout(velocity, z, sigmas, determistic, torch.Generator().manual_seed(4))
    ours = sample_trajectory(
        velocity, z, sigmas, kinds, noise_level=ETA, generator=torch.Generator().manual_seed(4)
    )
    assert rel_err(ours.latents, lat) < 1e-12
    assert torch.allclose(ours.log_probs[window], lp[window], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- port: train_one_step's loss
def their_window_backward(velocity, latents, sigmas, window, old_log_probs, advantages, grad_accum):
    """``train_one_step`` for one sample (train_batch_size 1): per trained step one forward (``grpo_one_step``:
    ``flow_grpo_step`` with ``prev_sample`` = the stored next latent), ratio, advantages clamped at
    ``adv_clip_max``, the clipped PPO loss over ``grad_accum * len(train_timesteps)``, KL coefficient 0, and
    ``loss.backward()`` per step."""
    for i in window:
        pred = velocity(latents[i], sigmas[i])
        _, new_log_probs, _ = their_flow_grpo_step(
            pred, latents[i], ETA, sigmas, i, latents[i + 1], noise=None, determistic=False
        )
        adv = torch.clamp(advantages, -ADV_CLIP, ADV_CLIP)
        ratio = torch.exp(new_log_probs - old_log_probs[i])
        unclipped_loss = -adv * ratio
        clipped_loss = -adv * torch.clamp(ratio, 1.0 - CLIP, 1.0 + CLIP)
        policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss)) / (grad_accum * len(window))
        kl_loss = 0.5 * torch.mean((new_log_probs - old_log_probs[i]) ** 2) / (grad_accum * len(window))
        (policy_loss + 0.0 * kl_loss).backward()


@pytest.mark.parametrize(("name", "it"), [("flux", 0), ("qwenimage", 300), ("mlp", 525), ("mlp", 550)])
def test_window_gradient_equals_their_loss_exactly_and_jagg_is_one_group_of_two_passes(name, it):
    """One sample (their train_batch_size 1) of a rollout on MixGRPO's window, the weights moved off the rollout's
    (so the ratios are not 1 and the clip binds somewhere), advantage 7.3 (clamped to 5). Our exact
    ``BackwardSetting.backward`` over ``GRPOStepLoss`` (as ``Trainer.grpo_loss`` builds it) equals their per-step
    loop; JAGG runs the window as one group with 2 backward passes."""
    module, velocity, shape = make_model(name, batch=1, seed=2)
    sigmas = shifted_linear_sigmas(25, 3.0)
    algo = mix(25)
    kinds = algo.step_kinds(25, torch.Generator(), iteration=it)
    window = [i for i, k in enumerate(kinds) if k != "ode"]
    z = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    traj = sample_trajectory(
        velocity, z, sigmas, kinds, noise_level=ETA, generator=torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    grad_accum, adv = 3, torch.tensor([7.3], dtype=torch.float64)
    module.zero_grad(set_to_none=True)
    their_window_backward(velocity, traj.latents, sigmas, window, traj.log_probs, adv, grad_accum)
    theirs = grads_of(module)

    steps = algo.trained_steps(list(kinds), 1, torch.Generator())  # (1, T)
    idx = steps[0]  # one sample: the trainer's at_steps(latents, idx, steps) is latents[steps[0]]
    loss = GRPOStepLoss(
        TrainedSteps(
            x=traj.latents[idx],
            x_next=traj.latents[idx + 1],
            sigma=sigmas[steps.T],
            sigma_next=sigmas[steps.T + 1],
            old_log_prob=traj.log_probs[idx],
        ),
        advantages=adv.clamp(-ADV_CLIP, ADV_CLIP),  # group_advantages(clip=adv_clip) clamps
        kind="flow_grpo",
        noise_level=ETA,
        clip_range=CLIP,
        scale=1.0 / (grad_accum * steps.shape[1]),
    )
    module.zero_grad(set_to_none=True)
    exact = BackwardSetting(routing=Routing(strategy="exact", group_size=4)).backward(velocity, loss)
    ours = grads_of(module)
    assert theirs.norm() > 0 and rel_err(ours, theirs) < 1e-12
    assert exact.backward_passes == len(window)
    ratios = [
        st.ppo.clip_frac
        for st in [loss.evaluate(j, velocity(loss.x[j], loss.sigma[j]))[1] for j in range(len(window))]
    ]
    assert max(ratios) > 0  # the off-policy ratios leave the clip range somewhere: the clip is exercised

    module.zero_grad(set_to_none=True)
    jagg = BackwardSetting(routing=Routing(strategy="jagg", group_size=4)).backward(velocity, loss)
    assert len(plan_groups(steps.shape[1], 4, 1.0, "jagg")) == 1  # the window is one group
    assert jagg.backward_passes == min(2, len(window))
    if len(window) <= 2:  # JAGG is exact at W <= 2 (their truncated windows near the end)
        assert rel_err(grads_of(module), theirs) < 1e-12
    else:
        assert torch.nn.functional.cosine_similarity(grads_of(module), theirs, dim=0) > 0.5


# --------------------------------------------------------------------------- the trainer
@pytest.mark.parametrize("config", WORLD)
def test_world_configs_run_one_tiny_iteration(tmp_path, config):
    cfg = tiny_config(tmp_path, "train.iterations=1", config=config)
    trainer = build_trainer(cfg)
    (m,) = trainer.fit()
    assert m["onpolicy_ratio_max_dev"] == 0.0 and m["skipped_steps"] == 0
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
    # LOOP_RUN: 6 steps, so their max_timesteps is 4 and the first window is [0, 4): one JAGG group of 4
    assert m["backward_passes"] == 2 * 2  # 2 micro-batches x (4 steps -> 2 passes)


def test_trainer_rollout_trains_the_iterations_window_and_a_fresh_trainer_draws_the_same(tmp_path):
    cfg = tiny_config(tmp_path, "algorithm.iters_per_group=2", "sampling.num_steps=8", config=WORLD[0])
    trainer = build_trainer(cfg)
    theirs = their_windows(8, 14, iters_per_group=2, group_size=4)
    for it in (0, 3, 8, 11, 13):
        ro = trainer.rollout(it)
        window = theirs[it] or [0, 1, 2, 3]
        assert [i for i, k in enumerate(ro.traj.kinds) if k != "ode"] == window
        assert ro.trained.tolist() == [window] * ro.trained.shape[0]
    a, b = (
        trainer.rollout(5),
        build_trainer(cfg).rollout(5),
    )  # a fresh trainer (as after --resume) draws the same
    assert torch.equal(a.traj.latents, b.traj.latents) and torch.equal(a.trained, b.trained)


def test_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """The window moves every iteration (iters_per_group 1): 4 iterations straight vs killed after 3 (checkpoint
    at 2) and resumed: every metrics row equal."""
    over = ("algorithm.iters_per_group=1", "train.iterations=4", "log.checkpoint_every=2")
    full = build_trainer(tiny_config(tmp_path / "full", *over, config=WORLD[0])).fit()
    cfg = tiny_config(tmp_path / "cut", *over, config=WORLD[0])

    def kill_after_third(row):
        if row["iteration"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_trainer(cfg).fit(progress=kill_after_third)
    resumed = build_trainer(cfg)
    resumed.load_checkpoint()
    assert resumed.iteration == 2
    again = resumed.fit()

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time_", "peak_memory"))} for r in rows]

    assert (
        strip(again) == strip(full) and len({r["backward_passes"] for r in full}) > 1
    )  # windows of 4, 3, 2, 1


# --------------------------------------------------------------------------- configs
@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("algorithm.sample_strategy=linear", r"algorithm.sample_strategy must be one of \['progressive'"),
        ("algorithm.group_size=0", r"algorithm.group_size must be >= 1, got 0"),
        ("algorithm.iters_per_group=0", r"algorithm.iters_per_group must be >= 1, got 0"),
        ("algorithm.prog_overlap_step=-1", r"algorithm.prog_overlap_step must be >= 0, got -1"),
        ("algorithm.min_iters_per_group=0", r"algorithm.min_iters_per_group must be >= 1, got 0"),
        ("algorithm.max_iters_per_group=0", r"algorithm.max_iters_per_group must be >= min_iters_per_group"),
        ("algorithm.exp_decay_k=-0.1", r"algorithm.exp_decay_k must be >= 0"),
        ("sampling.num_steps=2", r"sampling.num_steps >= 3"),
        ("algorithm.group_size=2.5", r"algorithm.group_size: expected int"),
    ],
)
def test_bad_values_exit_2_with_one_line_naming_the_key(tmp_path, capsys, override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(WORLD[0], [override])
    with pytest.raises(SystemExit) as exc:
        main(["--config", WORLD[0], f"log.run_dir={tmp_path / 'run'}", override])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert override.split("=")[0] in err or "sampling.num_steps" in err
    assert not (tmp_path / "run").exists()


def test_random_window_must_fit_the_trainable_steps():
    with pytest.raises(ConfigError, match=r"algorithm.group_size=9 does not fit the 8 trainable steps"):
        load_config(WORLD[0], ["algorithm.sample_strategy=random", "algorithm.group_size=9"])
    load_config(WORLD[0], ["algorithm.sample_strategy=random", "algorithm.group_size=8"])
    # progressive truncates a window longer than the schedule, as theirs: [0, S - 2)
    assert list(mix(6, group_size=9).window(0, 6, torch.Generator())) == [0, 1, 2, 3]


def test_validate_without_a_config_namespace_default():
    with pytest.raises(ConfigError, match="algorithm.sample_strategy"):
        MixGRPO.validate(SimpleNamespace(sample_strategy="x"), 25)


def test_paper_configs_follow_their_launch_script():
    """finetune_flux_grpo_MixGRPO.sh (e5cdd6a): every value this repository has a key for."""
    cfg = load_config(PAPER[0])
    a, b, o, t, s = cfg.algorithm, cfg.backward, cfg.optim, cfg.train, cfg.sampling
    assert (a.name, a.sde_kind, a.noise_level, a.group_size, a.sample_strategy) == (
        "mixgrpo",
        "flow_grpo",
        0.7,
        4,
        "progressive",
    )
    assert (a.iters_per_group, a.prog_overlap_step, a.clip_range, a.adv_clip, a.kl_beta) == (
        25,
        1,
        1e-4,
        5.0,
        0.0,
    )
    assert (a.adv_eps, a.adv_unbiased, a.adv_std, a.init_same_noise) == (1e-8, True, "group", True)
    assert (s.num_steps, s.shift, s.schedule, s.latent_size * 8) == (25, 3.0, "shift", 720)
    assert (o.lr, o.weight_decay, o.max_grad_norm, o.betas, o.eps, o.ema_decay) == (
        1e-5,
        1e-4,
        1.0,
        [0.9, 0.999],
        1e-8,
        0.0,
    )
    assert (t.iterations, t.images_per_prompt, t.grad_accum, t.train_batch_size, t.precision) == (
        300,
        12,
        3,
        1,
        "bf16",
    )
    assert t.prompts_per_iter == 32  # 32 GPUs x --train_batch_size 1
    assert (cfg.model.guidance_scale, cfg.model.lora_rank, cfg.model.gradient_checkpointing) == (3.5, 0, True)
    assert (b.strategy, b.group_size, b.jagg_frac) == ("jagg", 4, 1.0)  # the window is one JAGG group
    # --reward_model multi_reward (HPS, ImageReward, PickScore; unit weights) --multi_reward_mix advantage_aggr
    assert cfg.reward.weights == {"hpsv2": 1.0, "imagereward": 1.0, "pickscore": 1.0}
    assert a.adv_aggregation == "per_reward"
    qwen = load_config(PAPER[1])
    diff = {(sec, k) for sec, d in cfg.to_dict().items() for k in d if d[k] != qwen.to_dict()[sec][k]}
    assert diff == {
        ("model", "backbone"),
        ("model", "path"),
        ("data", "precompute_embeddings"),
        ("data", "embedding_cache"),
        ("log", "run_dir"),
    }


def test_world_configs_differ_from_the_world_base_only_in_the_algorithm_and_backward():
    base = load_config("configs/world/base.yaml").to_dict()
    for path in WORLD:
        cfg = load_config(path).to_dict()
        diff = {(sec, k) for sec, d in cfg.items() for k in d if d[k] != base[sec][k]}
        algo = {("algorithm", k) for k in ("name", "sde_kind", "noise_level", "iters_per_group")}
        expected = algo | {("backward", "group_size"), ("backward", "jagg_frac"), ("log", "run_dir")}
        if "qwenimage" in path:
            expected |= {("model", "backbone")}
        assert diff == expected, path


@pytest.mark.parametrize("config", PAPER)
def test_dry_run_plans_the_window_as_one_group(capsys, monkeypatch, tmp_path, config):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["--config", config, "--dry-run", "--world-size", "32", f"log.run_dir={tmp_path / 'r'}"]) == 0
    out = capsys.readouterr().out
    assert (
        "4 of 25" in out
        and "steps [0, 1, 2, 3] -> jagg" in out
        and "backward passes saved              50%" in out
    )
    assert "384 = 32 prompts x 12 images; 12 per rank in micro-batches of 1, step every 3" in out
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------- port: MixGRPO-Flash (run_sample_step, "post")
def sd3_time_shift(shift, t):
    return (shift * t) / (1 + (shift - 1) * t)


class TheirDPMState:
    """``DPMState``: the last ``order`` data predictions and how many updates were made (capped at ``order``)."""

    def __init__(self, order):
        self.order, self.model_outputs, self.lower_order_nums = order, [None] * order, 0

    def update(self, model_output):
        for i in range(self.order - 1):
            self.model_outputs[i] = self.model_outputs[i + 1]
        self.model_outputs[-1] = model_output

    def update_lower_order(self):
        if self.lower_order_nums < self.order:
            self.lower_order_nums += 1


def _alpha_sigma(sigma):
    return 1 - sigma, sigma


def their_first_order(model_output, sigmas, step_index, sample):
    """``dpm_solver_first_order_update``, dpmsolver++, ``sde_solver=False``."""
    alpha_t, sigma_t = _alpha_sigma(sigmas[step_index + 1])
    alpha_s, sigma_s = _alpha_sigma(sigmas[step_index])
    h = (torch.log(alpha_t) - torch.log(sigma_t)) - (torch.log(alpha_s) - torch.log(sigma_s))
    return (sigma_t / sigma_s) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * model_output


def their_second_order(model_output_list, sigmas, step_index, sample, solver_type):
    """``multistep_dpm_solver_second_order_update``, dpmsolver++, ``sde_solver=False``."""
    alpha_t, sigma_t = _alpha_sigma(sigmas[step_index + 1])
    alpha_s0, sigma_s0 = _alpha_sigma(sigmas[step_index])
    alpha_s1, sigma_s1 = _alpha_sigma(sigmas[step_index - 1])
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
    m0, m1 = model_output_list[-1], model_output_list[-2]
    h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
    r0 = h_0 / h
    D0, D1 = m0, (1.0 / r0) * (m0 - m1)
    if solver_type == "midpoint":
        return (
            (sigma_t / sigma_s0) * sample
            - (alpha_t * (torch.exp(-h) - 1.0)) * D0
            - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * D1
        )
    return (
        (sigma_t / sigma_s0) * sample
        - (alpha_t * (torch.exp(-h) - 1.0)) * D0
        + (alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)) * D1
    )


def their_dpm_step(order, solver_type, model_output, sample, step_index, timesteps, sigmas, dpm_state):
    """``dpm_step`` with a ``dpm_state`` and ``sde_solver=False`` (orders 1 and 2)."""
    lower_order_final = step_index == len(timesteps) - 1
    model_output = sample - sigmas[step_index] * model_output  # convert_model_output
    dpm_state.update(model_output)
    if order == 1 or dpm_state.lower_order_nums < 1 or lower_order_final:
        prev_sample = their_first_order(model_output, sigmas, step_index, sample)
    else:
        prev_sample = their_second_order(dpm_state.model_outputs, sigmas, step_index, sample, solver_type)
    dpm_state.update_lower_order()
    return prev_sample


def their_flash_rollout(velocity, z, sigma_schedule, determistic, gen, *, shift, ratio, order, solver_type):
    """``run_sample_step`` with ``dpm_algorithm_type="dpmsolver++"``, ``dpm_apply_strategy="post"`` and
    ``--flow_grpo_sampling``: the schedule rebuilt after the last SDE step, flow_grpo_step up to it (the
    data predictions fed to the DPM state), DPM-Solver++ after it."""
    dpm_state = TheirDPMState(order)
    last_false_index = len(determistic) - 1 - next(i for i, v in enumerate(reversed(determistic)) if not v)
    num_post_steps = int(max((sigma_schedule.size(0) - 1 - last_false_index) * ratio, 1))
    post_time_step = torch.linspace(1, 0, sigma_schedule.size(0), dtype=torch.float64)[
        last_false_index + 1
    ].item()
    post_sigma_schedule = sd3_time_shift(
        shift, torch.linspace(post_time_step, 0, num_post_steps, dtype=torch.float64)
    )
    sigma_schedule = torch.cat([sigma_schedule[: last_false_index + 1], post_sigma_schedule], dim=0)
    all_latents = [z]
    with torch.no_grad():
        for i in range(sigma_schedule.size(0) - 1):
            pred = velocity(z, sigma_schedule[i])
            if i <= last_false_index:
                dpm_state.update(z - sigma_schedule[i] * pred)
                noise = torch.randn(z.shape, generator=gen, dtype=torch.float64)
                z, _, _ = their_flow_grpo_step(pred, z, ETA, sigma_schedule, i, None, noise, determistic[i])
                dpm_state.update_lower_order()
            else:
                z = their_dpm_step(
                    order, solver_type, pred, z, i, sigma_schedule[:-1], sigma_schedule, dpm_state
                )
            all_latents.append(z)
    return sigma_schedule, torch.stack(all_latents)


FLASH = [
    # (iteration, ratio, order, solver): finetune_flux_grpo_MixGRPO_Flash.sh (0.4, 2, midpoint), Flash* (0.2),
    # heun and first order, windows at 0, 5, 20 (truncated) and 22 (n_post = 1: no DPM step)
    (0, 0.4, 2, "midpoint"),
    (125, 0.4, 2, "midpoint"),
    (130, 0.2, 2, "midpoint"),
    (60, 0.4, 2, "heun"),
    (75, 0.5, 1, "midpoint"),
    (500, 0.4, 2, "midpoint"),
    (550, 0.4, 2, "midpoint"),
]


@pytest.mark.parametrize(("it", "ratio", "order", "solver"), FLASH)
def test_flash_rollout_equals_their_post_dpm_solver_sampling(it, ratio, order, solver):
    _, velocity, shape = make_model("flux", batch=2, seed=6)
    sigmas = shifted_linear_sigmas(25, 3.0)
    algo = mix(
        25,
        dpm_algorithm_type="dpmsolver++",
        dpm_post_compress_ratio=ratio,
        dpm_solver_order=order,
        dpm_solver_type=solver,
    )
    kinds = algo.step_kinds(25, torch.Generator(), iteration=it)
    window = their_windows(25, it + 1, iters_per_group=25, group_size=4)[it]
    flash_sigmas, flash_kinds = algo.rollout_schedule(sigmas, kinds)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    their_sigmas, lat = their_flash_rollout(
        velocity,
        z,
        sigmas,
        [i not in window for i in range(25)],
        torch.Generator().manual_seed(8),
        shift=3.0,
        ratio=ratio,
        order=order,
        solver_type=solver,
    )
    assert torch.allclose(flash_sigmas, their_sigmas, rtol=0, atol=1e-14)
    ours = sample_trajectory(
        velocity, z, flash_sigmas, flash_kinds, noise_level=ETA, generator=torch.Generator().manual_seed(8)
    )
    assert ours.latents.shape == lat.shape and rel_err(ours.latents, lat) < 1e-12
    n_dpm = len(flash_kinds) - window[-1] - 1
    assert n_dpm == int(max((25 - window[-1]) * ratio, 1)) - 1 and flash_kinds[window[-1] + 1 :] == (
        [f"dpm2_{solver}" if order == 2 else "dpm1"] * (n_dpm - 1) + ["dpm1"] if n_dpm else []
    )
    assert algo.trained_steps(flash_kinds, 2, torch.Generator()).tolist() == [window] * 2
    assert torch.equal(
        flash_sigmas[: window[-1] + 2], sigmas[: window[-1] + 2]
    )  # the window's times unchanged
    if n_dpm:
        assert float(flash_sigmas[-1]) == 0.0 and len(flash_kinds) < 25


def test_flash_is_validated():
    with pytest.raises(
        ConfigError, match=r"algorithm.dpm_algorithm_type must be one of \['none', 'dpmsolver\+\+'\]"
    ):
        load_config(WORLD[0], ["algorithm.dpm_algorithm_type=dpmsolver"])
    with pytest.raises(ConfigError, match=r"needs algorithm.sample_strategy=progressive"):
        load_config(
            WORLD[0], ["algorithm.dpm_algorithm_type=dpmsolver++", "algorithm.sample_strategy=random"]
        )
    with pytest.raises(ConfigError, match=r"algorithm.dpm_post_compress_ratio must be in \(0, 1\]"):
        load_config(
            WORLD[0], ["algorithm.dpm_algorithm_type=dpmsolver++", "algorithm.dpm_post_compress_ratio=0"]
        )
    with pytest.raises(ConfigError, match=r"algorithm.dpm_solver_order must be 1 or 2, got 3"):
        load_config(WORLD[0], ["algorithm.dpm_solver_order=3"])
    with pytest.raises(ConfigError, match=r"needs sampling.schedule=shift, got 'scheduler'"):
        load_config(PAPER[0], ["algorithm.dpm_algorithm_type=dpmsolver++", "sampling.schedule=scheduler"])
    algo = mix(10, dpm_algorithm_type="dpmsolver++")
    with pytest.raises(ValueError, match="shifted-linear"):
        algo.rollout_schedule(
            torch.linspace(1, 0, 11, dtype=torch.float64) ** 2, ["flow_grpo"] * 4 + ["ode"] * 6
        )


def test_flash_trains_in_the_trainer_with_fewer_rollout_steps(tmp_path):
    cfg = tiny_config(
        tmp_path,
        "train.iterations=1",
        "sampling.num_steps=10",
        "algorithm.dpm_algorithm_type=dpmsolver++",
        config=WORLD[0],
    )
    trainer = build_trainer(cfg)
    ro = trainer.rollout(0)
    # window [0, 4); int((10 - 3) * 0.4) = 2 points after it: one DPM step (first order, the final one)
    assert ro.traj.kinds == ("flow_grpo",) * 4 + ("dpm1",) and ro.traj.latents.shape[0] == 6
    assert float(ro.traj.sigmas[-1]) == 0.0
    (m,) = trainer.fit()
    assert m["onpolicy_ratio_max_dev"] == 0.0 and math.isfinite(m["loss"]) and m["backward_passes"] == 4


def test_flash_scripts_load_as_overrides_of_the_paper_config():
    """finetune_flux_grpo_MixGRPO_Flash.sh and ..._Flash*.sh differ from MixGRPO's script only in these flags."""
    flash = ["algorithm.iters_per_group=20", "algorithm.dpm_algorithm_type=dpmsolver++"]
    star = [*flash, "algorithm.prog_overlap_step=0", "algorithm.dpm_post_compress_ratio=0.2"]
    for overrides, ratio, step in ((flash, 0.4, 1), (star, 0.2, 0)):
        cfg = load_config(PAPER[0], overrides)
        a = cfg.algorithm
        assert (a.dpm_post_compress_ratio, a.dpm_solver_order, a.dpm_solver_type) == (ratio, 2, "midpoint")
        algo = MixGRPO(a)
        sigmas = shifted_linear_sigmas(25, 3.0)
        kinds = algo.step_kinds(25, torch.Generator(), iteration=299)
        flash_sigmas, flash_kinds = algo.rollout_schedule(sigmas, kinds)
        start = 299 // 20 * step  # Flash: start 14 at the last iteration; Flash*: always 0
        assert [i for i, k in enumerate(flash_kinds) if k == "flow_grpo"] == list(range(start, start + 4))
        assert len(flash_kinds) == start + 4 + int((25 - start - 3) * ratio) - 1 and flash_sigmas[-1] == 0
