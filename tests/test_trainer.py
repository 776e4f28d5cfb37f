"""The training loop end to end on tiny random-init world backbones (seconds per run)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers import build_trainer, previous_step_loss
from jagg.common import SeedStream, generator
from jagg.engine.routing import BackwardSetting, Routing
from jagg.engine.strategies import GRAPH_MODES, STRATEGIES
from jagg.loop.trainer import TrainingAborted
from jagg.ops.checkpoint import find_checkpoint, read_checkpoint, trainable_names
from jagg.rewards import REWARDS
from jagg.scale.optimizer import optimizer_steps

TIME_KEYS = ("time_", "peak_memory")


CASES = [
    ("configs/world/flux_dancegrpo.yaml", "flux"),
    ("configs/world/qwenimage_dancegrpo.yaml", "qwenimage"),
    ("configs/world/flux_flowgrpo_fast.yaml", "flux"),
    ("configs/world/qwenimage_flowgrpo_fast.yaml", "qwenimage"),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("config", "backbone"), CASES)
def test_smoke_two_iterations_on_policy(tmp_path, config, backbone, strategy, tiny_cfg):
    cfg = tiny_cfg(f"backward.strategy={strategy}", config=config)
    assert cfg.model.backbone == backbone
    trainer = build_trainer(cfg)
    before = [p.detach().clone() for p in trainer.params]
    metrics = trainer.fit()
    assert [m["iteration"] for m in metrics] == [1, 2]
    for m in metrics:
        # on-policy: before the first optimizer step of every iteration each PPO ratio is exactly 1
        assert m["onpolicy_ratio_max_dev"] == 0.0
        assert m["skipped_steps"] == 0 and m["optimizer_steps"] == 2
        assert all(map(torch.isfinite, map(torch.tensor, (m["loss"], m["grad_norm"]))))
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.params))
    assert find_checkpoint(tmp_path) == tmp_path / "checkpoint"  # sharded (DCP) checkpoint directory
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2


@pytest.mark.parametrize(
    ("strategy", "graph_mode", "reuse"),
    [
        ("exact", "batched", True),
        ("endpoints", "batched", True),
        *[("jagg", e, r) for e in GRAPH_MODES for r in (True, False)],
    ],
)
def test_pass_counts_follow_routing_and_the_cost_model(tmp_path, strategy, graph_mode, reuse, tiny_cfg):
    """Flow-GRPO-Fast window of 3 = one group; 2 micro-batches with an optimizer step after each. Only the
    first micro-batch (before the first optimizer step) may use the rollout's stored outputs; the counts equal
    the cost model's (``BackwardSetting.cost``), which the dry-run plan, the bench and Table 1 use."""
    cfg = tiny_cfg(
        f"backward.strategy={strategy}",
        f"backward.graph_mode={graph_mode}",
        f"backward.stored_outputs={reuse}",
        "backward.jagg_frac=1.0",
        "train.iterations=1",
        config="configs/world/flux_flowgrpo_fast.yaml",
    )
    trainer = build_trainer(cfg)
    (m,) = trainer.fit()
    assert m["optimizer_steps"] == 2
    setting = BackwardSetting(
        routing=Routing(strategy=strategy, group_size=cfg.backward.group_size), graph_mode=graph_mode
    )
    first, second = (setting.cost(3, stored_outputs=r) for r in (reuse, False))
    expected = first + second
    assert expected == trainer.setting.update_cost(3, micro_batches=2, grad_accum=1)
    for key in ("forward_passes", "forward_calls", "forwards_skipped", "backward_passes", "backward_calls"):
        assert m[key] == getattr(expected, key), key
    if strategy == "jagg":
        assert m["forwards_skipped"] == (1 if reuse else 0)  # the window's one intermediate step, once
    assert m["onpolicy_ratio_max_dev"] <= (0.0 if reuse or graph_mode != "batched" else 1e-6)


@pytest.mark.parametrize("asynchronous", ["false", "true"])
def test_resume_reproduces_uninterrupted_run(tmp_path, tiny_cfg, asynchronous):
    """With log.async_checkpoint the interrupt finds iteration 2's save in flight: fit finishes it on the way out
    (one process), so the resume starts from it as from a synchronous one."""
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    over = ("train.iterations=4", "log.checkpoint_every=2", "log.eval_every=2", "reward.eval=[jpeg]")
    full = build_trainer(tiny_cfg(*over, run_dir=full_dir)).fit()

    cfg = tiny_cfg(*over, f"log.async_checkpoint={asynchronous}", run_dir=cut_dir)
    trainer = build_trainer(cfg)

    def kill_after_third(row):
        if row["iteration"] == 3:
            raise KeyboardInterrupt  # simulated kill after the checkpoint at iteration 2

    with pytest.raises(KeyboardInterrupt):
        trainer.fit(progress=kill_after_third)
    resumed = build_trainer(cfg)
    resumed.load_checkpoint()
    assert resumed.iteration == 2
    again = resumed.fit()

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows]

    assert strip(again) == strip(full)
    lines = (cut_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("asynchronous", ["false", "true"])
def test_nan_rewards_skip_updates_then_abort_with_checkpoint(tmp_path, monkeypatch, tiny_cfg, asynchronous):
    class NaNReward:
        def __call__(self, images, prompts):
            return torch.full((images.shape[0],), float("nan"))

    monkeypatch.setitem(REWARDS, "nan_test", lambda device=None: NaNReward())
    cfg = tiny_cfg(
        "reward.weights={nan_test: 1.0}",
        "train.iterations=5",
        "train.max_consecutive_skips=3",
        f"log.async_checkpoint={asynchronous}",
    )
    trainer = build_trainer(cfg)
    before = [p.detach().clone() for p in trainer.params]
    # two optimizer steps per iteration: 2 skips after iteration 1, 4 >= 3 after iteration 2
    with pytest.raises(TrainingAborted, match="4 consecutive optimizer steps had a non-finite"):
        trainer.fit()
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.params))  # no update went through
    assert trainer.metrics[-1]["skipped_steps"] == 2 and trainer.iteration == 2
    assert find_checkpoint(tmp_path) is not None and trainer.checkpoints.pending is None
    assert not (tmp_path / "checkpoint.tmp").exists()  # complete before the abort


def test_gradient_checkpointing_gives_identical_training(tmp_path, tiny_cfg):
    """Checkpointing recomputes activations; the metrics of an iteration must not change."""
    runs = []
    for gc in (False, True):
        cfg = tiny_cfg(
            f"model.gradient_checkpointing={str(gc).lower()}",
            "train.iterations=1",
            run_dir=tmp_path / str(gc),
        )
        trainer = build_trainer(cfg)
        (m,) = trainer.fit()
        runs.append(
            (
                {k: v for k, v in m.items() if not k.startswith(TIME_KEYS)},
                [p.detach().clone() for p in trainer.params],
            )
        )
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_ema_tracks_parameters_and_is_used_for_eval(tmp_path, tiny_cfg):
    cfg = tiny_cfg("optim.ema_decay=0.5", "train.iterations=2", "log.eval_every=2")
    trainer = build_trainer(cfg)
    init = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    # EMA lies strictly between the initial and the current weights for a parameter that moved
    moved = [(e, i, p) for e, i, p in zip(trainer.ema, init, trainer.params) if not torch.equal(i, p)]
    assert moved
    e, i, p = moved[0]
    assert not torch.equal(e, p) and not torch.equal(e, i)
    ckpt = read_checkpoint(tmp_path / "checkpoint")
    ema = [ckpt[f"ema.{n}"] for n in trainable_names(trainer.backbone)]
    assert len(ema) == len(trainer.params) and all(torch.equal(a, b) for a, b in zip(ema, trainer.ema))


def test_eval_at_evaluates_after_exactly_those_iterations(tmp_path, tiny_cfg):
    """``log.eval_at`` (an equal-cost arm's evaluations at fractions of its budget): the base model and each
    listed iteration, none other; with ``eval_every`` as well, the union."""
    cfg = tiny_cfg("train.iterations=5", "log.eval_every=0", "log.eval_at=[0,2,5]")
    rows = build_trainer(cfg).fit()
    evaluated = [m["iteration"] for m in rows if any(k.startswith("eval_") for k in m)]
    assert evaluated == [0, 2, 5]
    cfg = tiny_cfg("train.iterations=5", "log.eval_every=4", "log.eval_at=[1]", run_dir=tmp_path / "union")
    rows = build_trainer(cfg).fit()
    assert [m["iteration"] for m in rows if any(k.startswith("eval_") for k in m)] == [0, 1, 4, 5]


def test_ema_cadence_warmup_and_repeats_equal_a_hand_computation(tiny_cfg):
    """Flow-GRPO's EMA (flow_grpo/ema.py:33-49 @ ac4c86e) with k = 3, two applications per update: after
    optimizer steps 2, 5, 8 only, at decay min((1 + s) / (10 + s), 0.9), each applied twice on the same
    weights; recomputed by hand from the weights after every step (float64)."""
    cfg = tiny_cfg(
        "train.precision=fp64",
        "train.iterations=4",  # 2 optimizer steps an iteration: steps 1..8
        "optim.ema_decay=0.9",
        "optim.ema_every=3",
        "optim.ema_warmup=true",
        "optim.ema_repeats=2",
    )
    trainer = build_trainer(cfg)
    expected = [p.detach().clone() for p in trainer.params]
    after_step = []
    trainer.optimizer.register_step_post_hook(
        lambda *_: after_step.append([p.detach().clone() for p in trainer.params])
    )
    trainer.fit()
    assert len(after_step) == 8
    for s, weights in enumerate(after_step, start=1):
        if (s + 1) % 3:
            continue
        d = min((1 + s) / (10 + s), 0.9)
        for _ in range(2):
            expected = [d * e + (1 - d) * w for e, w in zip(expected, weights, strict=True)]
    assert all(e.dtype == torch.float64 for e in trainer.ema)
    for got, want in zip(trainer.ema, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    # the last update (step 8) is not the weights of step 8 nor an every-step EMA's
    assert not torch.equal(trainer.ema[0], after_step[-1][0])


def test_ema_decay_at_follows_flow_grpo_schedule():
    from jagg.config import OptimConfig
    from jagg.scale.optimizer import ema_decay_at

    theirs = OptimConfig(ema_decay=0.9, ema_every=8, ema_warmup=True, ema_repeats=2)
    assert [s for s in range(1, 40) if ema_decay_at(theirs, s) is not None] == [7, 15, 23, 31, 39]
    assert ema_decay_at(theirs, 7) == (8 / 17) ** 2
    assert ema_decay_at(theirs, 95) == 0.9**2  # (96 / 105) > 0.9: the warm-up is over
    plain = OptimConfig(ema_decay=0.5)
    assert [ema_decay_at(plain, s) for s in (1, 2, 3)] == [0.5, 0.5, 0.5]
    assert ema_decay_at(OptimConfig(), 1) is None  # no EMA


@pytest.mark.parametrize("key", ["ema_every", "ema_repeats"])
def test_ema_cadence_is_validated(tiny_cfg, key):
    from jagg.errors import ConfigError

    with pytest.raises(ConfigError, match=f"optim.{key} must be >= 1, got 0"):
        tiny_cfg(f"optim.{key}=0")


def test_bf16_autocast_smoke(tmp_path, tiny_cfg):
    cfg = tiny_cfg("train.precision=bf16", "train.iterations=1")
    (m,) = build_trainer(cfg).fit()
    assert m["onpolicy_ratio_max_dev"] == 0.0  # stored samples are scored in float32 both times
    assert torch.isfinite(torch.tensor(m["loss"]))


def test_init_same_noise_shares_the_initial_latent_within_a_prompt_group(tiny_trainer):
    ro = tiny_trainer("algorithm.init_same_noise=true").rollout(0)
    x_t = ro.traj.latents[0]  # (N, C, H, W), 2 prompts x 3 images
    assert torch.equal(x_t[0], x_t[1]) and torch.equal(x_t[0], x_t[2]) and not torch.equal(x_t[0], x_t[3])
    assert not torch.equal(ro.traj.final[0], ro.traj.final[1])  # the SDE noise still differs


def test_dancegrpo_outputs_the_last_steps_x0_prediction(tiny_trainer):
    """DanceGRPO decodes ``pred_original = x - sigma v`` of the last step, not its noisy sample: the last step
    is deterministic (log-prob 0), never trained, and every earlier step is stochastic."""
    trainer = tiny_trainer()
    ro = trainer.rollout(0)
    traj, sigmas = ro.traj, trainer.sigmas
    assert traj.kinds == ("dance",) * 5 + ("ode",)
    x_last = traj.latents[-2]
    with torch.no_grad():
        v = trainer.velocity(ro.cond)(x_last, sigmas[-2])
    pred_original = x_last.double() - sigmas[-2] * v.double()
    torch.testing.assert_close(traj.final.double(), pred_original, rtol=1e-6, atol=1e-6)
    assert torch.all(traj.log_probs[-1] == 0) and torch.all(traj.log_probs[:-1] != 0)
    steps = trainer.algorithm.trained_steps(list(traj.kinds), 64, torch.Generator().manual_seed(0))
    assert steps.max() < len(traj.kinds) - 1


def test_stored_outputs_are_read_before_the_first_optimizer_step_only(tmp_path, tiny_cfg):
    """Both halves of ``backward.stored_outputs``: poisoning the stored outputs of the SECOND micro-batch (after
    the first optimizer step) changes nothing, bit for bit, against a run that never reuses; poisoning those
    of the FIRST micro-batch does change the update (they are read)."""

    def run(reuse: bool, poison: slice | None, sub: str):
        cfg = tiny_cfg(
            "backward.strategy=jagg",
            "backward.graph_mode=joint",  # endpoint forwards at the rollout's batch size: bit-identical outputs
            f"backward.stored_outputs={reuse}",
            "backward.jagg_frac=1.0",
            "train.iterations=1",
            config="configs/world/flux_flowgrpo_fast.yaml",
            run_dir=tmp_path / sub,
        )
        trainer = build_trainer(cfg)
        rollout = trainer.rollout

        def poisoned_rollout(it):
            ro = rollout(it)
            if poison is not None:
                ro.traj.outputs[:, poison] = float("nan")
            return ro

        trainer.rollout = poisoned_rollout
        (m,) = trainer.fit()
        return m, [p.detach().clone() for p in trainer.params]

    m_ref, ref = run(False, None, "ref")
    m_late, late = run(True, slice(3, 6), "late")  # micro-batch 2 of 2 (train_batch_size 3)
    assert m_late["forwards_skipped"] == 1 and m_late["skipped_steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(ref, late))
    assert m_late["loss"] == m_ref["loss"]
    m_early, _ = run(True, slice(0, 3), "early")  # micro-batch 1: its signals come from the stored outputs
    assert m_early["skipped_steps"] == 1  # the NaN signals made the first update non-finite


def test_a_second_update_on_one_rollout_does_not_reuse_its_outputs(tiny_cfg):
    """Stored outputs are the rollout's weights' outputs: after an optimizer step (here: the whole first
    update) they are stale. A second update on the same rollout recomputes every signal (no forward skipped,
    exactly the counts of an update that never reuses) and sees the ratios move off 1."""
    cfg = tiny_cfg(
        "backward.strategy=jagg",
        "backward.jagg_frac=1.0",
        "train.grad_accum=2",  # one optimizer step per update: both micro-batches read stored outputs
        config="configs/world/flux_flowgrpo_fast.yaml",
    )
    trainer = build_trainer(cfg)
    ro = trainer.rollout(0)
    first = trainer.update(ro)
    assert first["forwards_skipped"] == 2 and first["onpolicy_ratio_max_dev"] == 0.0
    second = trainer.update(ro)
    assert second["optimizer_steps"] == 1 and optimizer_steps(trainer.optimizer) == 2
    assert second["forwards_skipped"] == 0
    assert second["onpolicy_ratio_max_dev"] > 1e-4  # off-policy now: the stale outputs would have given 0
    assert trainer.setting.graph_mode == "batched"
    fresh = trainer.setting.cost(ro.trained.shape[1], stored_outputs=False)
    assert second["forward_passes"] == 2 * fresh.forward_passes


@pytest.mark.parametrize("kl_std", ["flow_grpo", "step"])
def test_grpo_loss_equals_the_previous_inline_step_loss_bit_for_bit(tmp_path, kl_std, tiny_cfg):
    """``Trainer.grpo_loss`` (the engine's ``GRPOStepLoss`` on a rollout's trained steps, KL reference on) gives
    every step's loss and gradient exactly as the formula the trainer inlined before."""
    trainer = build_trainer(tiny_cfg("algorithm.kl_beta=0.1", f"algorithm.kl_std={kl_std}"))
    with torch.no_grad():  # move the policy off the reference, or the KL term would be exactly 0
        for p in trainer.params:
            p.add_(1e-2 * torch.randn_like(p))
    ro = trainer.rollout(0)
    idx = slice(3, 6)  # the second micro-batch
    steps = ro.trained[idx]  # (b, T)
    scale = 1 / (2 * steps.shape[1])
    new = trainer.grpo_loss(ro, steps, idx, scale=scale)
    cols = torch.arange(steps.shape[0])[None, :]
    lat = ro.traj.latents[:, idx]
    sig = trainer.sigmas
    a = trainer.cfg.algorithm
    old = previous_step_loss(
        lat[steps.T, cols],
        lat[steps.T + 1, cols],
        sig[steps.T],
        sig[steps.T + 1],
        ro.traj.log_probs[:, idx][steps.T, cols],
        ro.advantages[idx],
        dict(
            kind=a.sde_kind,
            noise_level=a.noise_level,
            clip_range=a.clip_range,
            kl_beta=a.kl_beta,
            kl_std=kl_std,
        ),
        trainer.velocity(ro.cond.select(idx), trainer.reference),
        scale,
        [],
    )
    velocity = trainer.velocity(ro.cond.select(idx))
    assert len(new) == steps.shape[1] and new.kl_beta == 0.1 and new.kl_std == kl_std
    with torch.no_grad():  # the KL term is really there
        v0 = velocity(new.x[0], new.sigma[0])
        assert new(0, v0).item() != dataclasses.replace(new, kl_beta=0.0)(0, v0).item()
    for i in range(len(new)):
        out = []
        for fn in (old, new):
            trainer.optimizer.zero_grad(set_to_none=True)
            loss = fn(i, velocity(new.x[i], new.sigma[i]))
            loss.backward()
            out.append((loss.detach(), torch.cat([p.grad.flatten() for p in trainer.params])))
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_named_seed_streams_keep_the_previous_seeds():
    """``generator(seed, stream, index)`` seeds exactly what the drivers' magic offsets did."""
    before = lambda seed, it: seed * 1_000_003 + it * 7919  # the former _iteration_generator(seed, it)
    assert generator(3, SeedStream.ROLLOUT, 7).initial_seed() == before(3, 7)
    assert generator(3, SeedStream.EVAL).initial_seed() == before(3, -1)
    assert generator(0, SeedStream.WARMUP).initial_seed() == before(0, 10_000)  # table1 rollout(10_000)
    assert generator(0, SeedStream.MEMORY).initial_seed() == before(0, 20_000)  # table1 rollout(20_000)
    assert generator(1, SeedStream.FINETUNE, 4).initial_seed() == before(
        1, 50_004
    )  # cosine rollout(50_000 + it)


@pytest.mark.parametrize(("min_cosine", "routed"), [(-1.0, "jagg"), (1.0, "exact")])
def test_auto_routing_calibrates_logs_and_routes(tmp_path, min_cosine, routed, tiny_cfg):
    """``backward.jagg_frac=auto``: the cosine of the group's JAGG gradient to its exact one is measured at
    iteration 0 (and every ``calibrate_every``), logged, and decides the routing. The tiny DanceGRPO run trains
    3 steps = one group of W = 3: a threshold of -1 routes it to JAGG (2 backward passes per sample), 1.0 (which
    an approximate group cannot reach) to exact (3), as the cost model says. The routing survives a resume."""
    cfg = tiny_cfg(
        "backward.jagg_frac=auto",
        f"backward.min_cosine={min_cosine}",
        "backward.calibrate_every=2",
        "train.iterations=3",
        "log.checkpoint_every=1",
    )
    trainer = build_trainer(cfg)
    rows = trainer.fit()
    assert [("routing" in r) for r in rows] == [True, False, True]  # iterations 0 and 2
    cal = rows[0]
    assert cal["routing"] == [routed] and len(cal["calibration_cosines"]) == 1
    assert 0.0 < cal["calibration_cosines"][0] < 1.0 and cal["time_calibrate_s"] > 0
    expected = BackwardSetting(routing=Routing(strategy=routed, group_size=3)).cost(3)
    per_sample = expected.backward_passes
    assert all(r["backward_passes_per_sample"] == per_sample for r in rows)
    resumed = build_trainer(cfg)
    resumed.load_checkpoint()
    assert resumed.setting == trainer.setting
    assert trainer.setting.routing.measured == (routed == "jagg",)


def test_jagg_frac_auto_is_validated(tmp_path, tiny_cfg):
    from jagg.errors import ConfigError

    with pytest.raises(ConfigError, match=r"backward.jagg_frac must be a number in \[0, 1\] or 'auto'"):
        tiny_cfg("backward.jagg_frac=sometimes")
    with pytest.raises(ConfigError, match="backward.min_cosine"):
        tiny_cfg("backward.jagg_frac=auto", "backward.min_cosine=2")
    assert tiny_cfg("backward.jagg_frac=0.5").backward.jagg_frac == 0.5


@pytest.mark.parametrize(("min_cosine", "w", "passes"), [(-1.0, 3, 2), (1.0, 2, 3)])
def test_group_size_auto_keeps_the_cheapest_qualifying_w(tmp_path, min_cosine, w, passes, tiny_cfg):
    """``backward.group_size=auto``: each candidate W is measured and routed; the W whose routed update the
    cost model predicts cheapest is kept. Tiny DanceGRPO trains T = 3 steps. With every cosine accepted, W = 3
    is one JAGG group (2 forwards + 2 backwards) and beats W = 2 ([2-step JAGG group] + [1 exact step]: 3 + 3).
    With no approximate group accepted, W = 3 falls back to exact (3 + 3) and ties with W = 2 (its 2-step group
    is exact JAGG and always qualifies): the tie goes to the smaller W. W and the routing survive a resume."""
    cfg = tiny_cfg(
        "backward.jagg_frac=auto",
        "backward.group_size=auto",
        "backward.group_sizes=[2, 3]",
        f"backward.min_cosine={min_cosine}",
        "train.iterations=2",
        "log.checkpoint_every=1",
    )
    trainer = build_trainer(cfg)
    rows = trainer.fit()
    cal = rows[0]
    assert cal["group_size"] == w == trainer.setting.routing.group_size
    by_w = cal["calibration_by_group_size"]
    assert set(by_w) == {"2", "3"} and by_w["2"]["routing"][0] is True  # a 2-step group always qualifies
    assert by_w[str(w)]["predicted_cost"] <= min(c["predicted_cost"] for c in by_w.values())
    # the cost of the whole update: 2 micro-batches, a step after each, stored outputs for the first only
    assert trainer.setting.graph_mode == "batched"
    stored, fresh = (trainer.setting.cost(3, stored_outputs=r) for r in (True, False))
    assert by_w[str(w)]["predicted_cost"] == (stored + fresh).time()
    assert all(r["backward_passes_per_sample"] == passes for r in rows)
    resumed = build_trainer(cfg)
    resumed.load_checkpoint()
    assert resumed.setting.routing.group_size == w and resumed.setting == trainer.setting


def test_group_size_auto_is_validated(tmp_path, tiny_cfg):
    from jagg.errors import ConfigError

    with pytest.raises(ConfigError, match="set backward.jagg_frac=auto too"):
        tiny_cfg("backward.group_size=auto")
    with pytest.raises(ConfigError, match="backward.group_size must be an integer >= 2 or 'auto'"):
        tiny_cfg("backward.group_size=big", "backward.jagg_frac=auto")
    with pytest.raises(ConfigError, match="backward.group_sizes must be a non-empty list of integers >= 2"):
        tiny_cfg("backward.group_size=auto", "backward.jagg_frac=auto", "backward.group_sizes=[1, 3]")


def test_eval_only_judges_are_refused_as_training_rewards(tmp_path, tiny_cfg):
    from jagg.errors import ConfigError

    with pytest.raises(ConfigError, match="reward.weights: attr_judge is an eval-only judge"):
        tiny_cfg("reward.weights={jpeg: 1.0, attr_judge: 1.0}")
