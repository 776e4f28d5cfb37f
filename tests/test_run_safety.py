"""What a first paper-scale run needs beyond the numerics: the process group's timeout from the config, one
checkpoint at the end, a resume that checks the embedding cache without loading it, eval rewards only at
evaluation, fp32 rotary tables under bf16 FSDP2 and verified checkpoints (issue 19)."""

from __future__ import annotations

import pytest
import torch

from jagg.config import TINY_OVERRIDES, load_config
from jagg.errors import ConfigError
from jagg.train import main

TINY = [*TINY_OVERRIDES, "train.iterations=1", "train.prompts_per_iter=1", "train.images_per_prompt=2"]
TINY += ["train.train_batch_size=2", "sampling.num_steps=4", "log.eval_every=0"]


# --------------------------------------------------------------------------- process-group timeout
class _Stop(Exception):
    pass


@pytest.mark.parametrize(("override", "seconds"), [([], 3600), (["train.dist_timeout_s=123"], 123)])
def test_dist_timeout_reaches_init_process_group(tmp_path, monkeypatch, override, seconds):
    import torch.distributed as dist

    seen = {}

    def fake_init(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise _Stop

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    args = [
        "--config",
        "configs/world/flux_dancegrpo.yaml",
        *TINY,
        f"log.run_dir={tmp_path / 'r'}",
        *override,
    ]
    with pytest.raises(_Stop):
        main(args)
    assert seen["timeout"].total_seconds() == seconds


def test_dist_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="train.dist_timeout_s must be >= 1"):
        load_config("configs/world/flux_dancegrpo.yaml", ["train.dist_timeout_s=0"])


# --------------------------------------------------------------------------- one checkpoint at the end
def _tiny_trainer(tmp_path, *overrides):
    from jagg.loop.components import build_components
    from jagg.loop.trainer import Trainer

    cfg = load_config("configs/world/flux_dancegrpo.yaml", [*TINY, f"log.run_dir={tmp_path}", *overrides])
    return Trainer(cfg, build_components(cfg), tmp_path)


def _count_saves(monkeypatch) -> list[int]:
    import jagg.loop.trainer as trainer_module

    saved: list[int] = []
    real = trainer_module.save_checkpoint

    def counted(run_dir, **kw):
        saved.append(kw["progress"].iteration)
        return real(run_dir, **kw)

    monkeypatch.setattr(trainer_module, "save_checkpoint", counted)
    return saved


@pytest.mark.parametrize(("every", "expected"), [(1, [1, 2]), (2, [2]), (0, [2]), (3, [2])])
def test_one_checkpoint_per_iteration_at_most(tmp_path, monkeypatch, every, expected):
    saved = _count_saves(monkeypatch)
    _tiny_trainer(tmp_path, "train.iterations=2", f"log.checkpoint_every={every}").fit()
    assert saved == expected
    resumed = _tiny_trainer(tmp_path, "train.iterations=2", f"log.checkpoint_every={every}")
    resumed.load_checkpoint()
    resumed.fit()  # nothing left to train: the checkpoint it loaded is not written again
    assert saved == expected


# --------------------------------------------------------------------------- embedding cache on resume
class _CountingEncoder:
    """Stands in for the text encoders: one random row per prompt, counting the prompts it encodes."""

    def __init__(self) -> None:
        self.encoded = 0

    def encode_prompts(self, prompts):
        from jagg.models import TextCond

        self.encoded += len(prompts)
        return TextCond(embeds=torch.randn(len(prompts), 3, 4), pooled=torch.randn(len(prompts), 4))


def test_precompute_checks_the_cache_by_existence(tmp_path, monkeypatch):
    from jagg.scale.pipelines import CachedTextEncoder

    prompts = [f"prompt {i}" for i in range(5)]
    first = CachedTextEncoder(_CountingEncoder(), cache_dir=tmp_path)
    assert first.precompute(prompts) == 5 and len(list(tmp_path.glob("*.pt"))) == 5
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(a) or real_load(*a, **kw))
    again = CachedTextEncoder(_CountingEncoder(), cache_dir=tmp_path)  # what a resumed run builds
    assert again.precompute([*prompts, "a new one"]) == 1 and again.encoder.encoded == 1
    assert loads == []  # nothing read back to see that it is there
    again.release()
    cond = again.encode_prompts(prompts[:2])  # read when used
    assert len(loads) == 2 and cond.batch_size == 2


# --------------------------------------------------------------------------- eval rewards at evaluation only
class _CountingReward:
    def __init__(self) -> None:
        self.batches = 0

    def __call__(self, images, prompts):
        self.batches += 1
        return images.flatten(1).float().mean(1)


@pytest.mark.parametrize("on_train", [False, True])
def test_eval_rewards_score_training_batches_only_when_asked(tmp_path, monkeypatch, on_train):
    from jagg.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "counting_test", _CountingReward)
    trainer = _tiny_trainer(
        tmp_path,
        "reward.eval=[jpeg, counting_test]",
        "log.eval_every=1",
        "log.eval_prompts=2",
        f"log.eval_rewards_on_train={str(on_train).lower()}",
    )
    rows = trainer.fit()
    calls = trainer.eval_rewards["counting_test"].batches
    assert calls == 2 + on_train  # the evaluations at iterations 0 and 1 (+ the one training batch)
    assert ("reward_counting_test_mean" in rows[-1]) == on_train and "eval_counting_test_mean" in rows[-1]
    assert "reward_jpeg_mean" in rows[-1]  # the training reward's own score is always logged


def test_paper_configs_score_training_batches_with_the_training_reward_only():
    from pathlib import Path

    for path in sorted(Path("configs/paper").glob("*_*.yaml")):
        assert not load_config(path).log.eval_rewards_on_train, path
    assert load_config(
        "configs/world/flux_dancegrpo.yaml"
    ).log.eval_rewards_on_train  # world_rl_report reads them


# --------------------------------------------------------------------------- rotary tables stay fp32 under FSDP2
@pytest.fixture
def one_rank_group(tmp_path):
    """A world-size-1 gloo process group in this process (FSDP2 needs one), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rotary_dtypes(backbone) -> list[torch.dtype]:
    """Run one bf16-autocast forward (fp32 latents, as the trainer's); the dtypes of every tensor in the
    ``image_rotary_emb`` each block hands to its attention (after FSDP2's pre-forward hooks)."""
    from jagg.models import TextCond
    from jagg.scale.distributed import transformer_blocks

    seen: list[torch.dtype] = []

    def record(module, args, kwargs):
        seen.extend(t.dtype for t in kwargs["image_rotary_emb"])

    hooks = [
        b.attn.register_forward_pre_hook(record, with_kwargs=True)
        for b in transformer_blocks(backbone.transformer)
    ]
    g = torch.Generator().manual_seed(0)
    cond = TextCond(
        embeds=torch.randn(2, 5, 32, generator=g),
        mask=torch.ones(2, 5, dtype=torch.long),
        pooled=torch.randn(2, 32, generator=g),
    )
    z = torch.randn(2, backbone.latent_channels, 8, 8, generator=g)
    with torch.autocast("cpu", torch.bfloat16):
        out = backbone.velocity(z, torch.full((2,), 0.5), cond)
    for h in hooks:
        h.remove()
    assert torch.isfinite(out.float()).all()
    return seen


@pytest.mark.parametrize(("name", "rotary"), [("flux", torch.float32), ("qwenimage", torch.complex64)])
def test_rotary_inputs_stay_fp32_under_bf16_fsdp2(one_rank_group, name, rotary):
    from jagg.loop.placement import mixed_precision
    from jagg.models import build_tiny_backbone
    from jagg.scale.distributed import shard_backbone

    unsharded = _rotary_dtypes(build_tiny_backbone(name, seed=1))  # world size 1: no FSDP2
    sharded = _rotary_dtypes(
        shard_backbone(build_tiny_backbone(name, seed=1), mp_policy=mixed_precision("bf16"))
    )
    assert set(unsharded) == {rotary}
    assert len(sharded) == len(unsharded) and set(sharded) == {rotary}  # not cast to bf16 by FSDP2
