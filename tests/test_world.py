"""The embedded world: deterministic renders, prompt splits, text encoder, backbones, cached-artefact checks.

Nothing here needs `make pretrain`: models are random-init or trained for a few steps.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from jagg.models import TextCond, build_tiny_backbone
from jagg.world import ArtefactError, World, WorldConfig, check_artefact, load_pretrained
from jagg.world.pretrained import (
    ARTEFACTS,
    expected_config,
    load_module,
    new_module,
    save_artefact,
    text_encoder_from_clip,
    world_backbone_config,
    world_build,
)
from jagg.world.train import FlowTrainConfig, preference_pairs, sample_images, train_flow


@pytest.fixture(scope="module")
def text_encoder(world):
    torch.manual_seed(0)
    return text_encoder_from_clip(new_module("clip", world), world)


def test_render_is_deterministic_in_seed(world):
    prompts = world.prompts[:5]
    a, b, c = world.render(prompts, seed=3), world.render(prompts, seed=3), world.render(prompts, seed=4)
    assert a.shape == (5, 3, 16, 16) and a.dtype == torch.float32
    assert a.min() >= 0 and a.max() <= 1
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # jitter differs with the seed


def test_render_puts_the_object_where_the_prompt_says(world):
    left = world.render(["a red circle on the left"], 0)[0]
    right = world.render(["a red circle on the right"], 0)[0]
    assert left[0, :, :8].sum() > left[0, :, 8:].sum()
    assert right[0, :, 8:].sum() > right[0, :, :8].sum()
    red = left[:, 8, 4]  # object centre on the left
    assert red[0] > 0.6 > red[1]


def test_prompt_splits_and_parsing(world):
    assert len(world.prompts) == 72 and len(set(world.prompts)) == 72
    assert set(world.train_prompts).isdisjoint(world.heldout_prompts)
    assert len(world.train_prompts) + len(world.heldout_prompts) == 72 and len(world.heldout_prompts) == 12
    c = world.config
    train_attrs = [world.parse(p) for p in world.train_prompts]
    for values, k in ((c.colors, 0), (c.shapes, 1), (c.positions, 2)):
        assert {a[k] for a in train_attrs} == set(values)  # held-out prompts are new *combinations*
    assert world.parse("an orange square at the top") == ("orange", "square", "top")
    assert world.labels(["a blue triangle on the right"]).tolist() == [[2, 2, 1]]
    with pytest.raises(ValueError, match="not in this world"):
        world.parse("a cat riding a bicycle")


def test_latent_codec_and_config_validation(world):
    x = world.render(world.prompts[:3], 0)
    z = world.encode(x)
    assert z.shape == (3, world.latent_channels, 16, 16) and z.min() >= -1 and z.max() <= 1
    assert torch.allclose(world.decode(z), x)
    assert World(WorldConfig(size=32)).render(["a red circle on the left"], 0).shape == (1, 3, 32, 32)
    with pytest.raises(ValueError, match="even"):
        WorldConfig(size=15)


def test_preference_pairs_differ_from_the_faithful_render(world):
    good, bad, idx, kinds = preference_pairs(world, 18, seed=0)
    assert good.shape == bad.shape == (18, 3, 16, 16) and idx.shape == (18,)
    assert len(set(kinds)) == 9
    assert (good - bad).abs().flatten(1).amax(1).gt(0.05).all()


def test_pixel_degradations_shared_by_image_and_clip_pairs(world):
    """``pixel_degradation``: noise grows with u, the noisy background leaves the object's pixels alone, faded
    pulls toward the background by 0.25 + 0.3 u, blur applies the given blur once (u >= 0.5) or twice; a clip's
    blur is the image blur on each frame (the video pairs' ``_blur_frames``)."""
    from jagg.world.train import box_blur, pixel_degradation
    from jagg.world.video_train import _blur_frames

    x, alpha, bg = world.render_attributes([world.parse(world.prompts[0])], np.random.default_rng(0))
    x, alpha, bg = x[0], alpha[0], bg[0]
    noise = [
        pixel_degradation("noise", x, alpha, bg, u, torch.Generator().manual_seed(1), None) for u in (0, 1)
    ]
    assert (noise[1] - x).abs().mean() > (noise[0] - x).abs().mean() > 0
    noisy = pixel_degradation("noisy_background", x, alpha, bg, 0.5, torch.Generator().manual_seed(1), None)
    assert torch.equal(noisy[:, alpha[0] == 1], x[:, alpha[0] == 1]) and not torch.equal(noisy, x)
    torch.testing.assert_close(pixel_degradation("faded", x, alpha, bg, 0.5, None, None), bg + (x - bg) * 0.4)
    once = lambda t: box_blur(t[None])[0]  # noqa: E731
    assert torch.equal(pixel_degradation("blur", x, alpha, bg, 0.7, None, once), once(x))
    assert torch.equal(pixel_degradation("blur", x, alpha, bg, 0.2, None, once), once(once(x)))
    clip = torch.stack([x, x.flip(-1), x.flip(-2)], dim=1)  # (3, F, H, W)
    assert torch.equal(_blur_frames(clip), torch.stack([once(clip[:, f]) for f in range(3)], dim=1))
    with pytest.raises(ValueError, match="unknown degradation"):
        pixel_degradation("motion", x, alpha, bg, 0.5, None, once)


def test_text_encoder_matches_backbone_conditioning(world, text_encoder):
    cond = text_encoder.encode_prompts(world.prompts[:4])
    assert isinstance(cond, TextCond)
    assert cond.embeds.shape == (4, 8, 32) and cond.mask.shape == (4, 8) and cond.pooled.shape == (4, 32)
    assert cond.mask.sum(1).tolist() == [8, 8, 8, 8]  # <bos> + 6 words + <eos>
    assert not cond.embeds.requires_grad
    with pytest.raises(ValueError, match="vocabulary"):
        text_encoder.encode_prompts(["a red dragon on the left"])


@pytest.mark.parametrize("name", ["flux", "qwenimage"])
def test_world_backbones_predict_velocities(world, text_encoder, name):
    """The ~1M-param world configs run through the same adapters as the real models."""
    backbone = new_module(name, world)
    z = world.encode(world.render(world.prompts[:2], 0))
    v = backbone.velocity(z, torch.tensor([0.3, 0.9]), text_encoder.encode_prompts(world.prompts[:2]))
    assert v.shape == z.shape and torch.isfinite(v).all()
    assert world_backbone_config(name, world)["in_channels"] == 4 * world.latent_channels


def test_flow_training_runs_and_samples(world, text_encoder):
    backbone = build_tiny_backbone("qwenimage", latent_channels=world.latent_channels)
    stats = train_flow(
        backbone, text_encoder, world, FlowTrainConfig(steps=3, batch=8, per_prompt=1, warmup=1)
    )
    assert stats["final_loss"] > 0 and stats["train_seconds"] > 0
    images = sample_images(backbone, text_encoder, world, world.heldout_prompts[:3], seed=0, steps=2)
    assert images.shape == (3, 3, 16, 16) and images.min() >= 0 and images.max() <= 1


def _write(tmp_path, name, module, config):
    manifest = {"name": name, "config": config}
    if name in ("flux", "qwenimage"):
        te = save_artefact("text_encoder", new_module("text_encoder", World()), {}, tmp_path)
        manifest["depends_on"] = {"text_encoder": te["sha256"]}
    return save_artefact(name, module, manifest, tmp_path)


def test_missing_cache_says_run_make_pretrain(tmp_path):
    with pytest.raises(ArtefactError, match="run `make pretrain`"):
        load_pretrained("flux", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="flux"):
        load_pretrained("sd3", cache_dir=tmp_path)


def test_cache_refuses_a_manifest_that_does_not_match_the_config(tmp_path, world):
    config = expected_config("attr")
    config["train"]["steps"] += 1  # trained with a different budget than the code expects
    _write(tmp_path, "attr", new_module("attr", world), config)
    with pytest.raises(ArtefactError, match=r"does not match this code's config \(differs in: train.steps\)"):
        load_module("attr", tmp_path)


def test_cache_loads_a_matching_artefact_and_detects_tampering(tmp_path, world):
    module = new_module("attr", world)
    _write(tmp_path, "attr", module, expected_config("attr"))
    loaded = load_module("attr", tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), loaded.state_dict().values()))
    manifest = json.loads((tmp_path / "attr.json").read_text())
    (tmp_path / "attr.json").write_text(json.dumps(manifest | {"sha256": "0" * 64}))
    with pytest.raises(ArtefactError, match="sha256"):
        check_artefact("attr", tmp_path)


def test_world_build_names_the_weights_of_every_cached_artefact(tmp_path, world):
    assert world_build(tmp_path) == {}
    attr = _write(tmp_path, "attr", new_module("attr", world), expected_config("attr"))
    assert world_build(tmp_path) == {"attr": attr["sha256"][:16]}
    torch.manual_seed(1)  # other weights: another build
    _write(tmp_path, "attr", new_module("attr", world), expected_config("attr"))
    assert world_build(tmp_path)["attr"] != attr["sha256"][:16]


def test_backbone_cache_checks_its_text_encoder(tmp_path, world):
    backbone = new_module("qwenimage", world)
    _write(tmp_path, "qwenimage", backbone, expected_config("qwenimage"))
    (tmp_path / "text_encoder.json").write_text(json.dumps({"config": expected_config("text_encoder")}))
    with pytest.raises(ArtefactError, match="different 'text_encoder'"):
        check_artefact("qwenimage", tmp_path)
    assert set(ARTEFACTS) == {"text_encoder", "clip", "pref", "attr", "flux", "qwenimage", "attr_judge"}
    assert ARTEFACTS.index("attr_judge") > ARTEFACTS.index("qwenimage")  # trained on the backbones' outputs


def test_eval_judge_cache_checks_the_backbones_it_was_trained_on(tmp_path, world):
    te = save_artefact("text_encoder", new_module("text_encoder", world), {}, tmp_path)
    deps = {"text_encoder": te["sha256"]}
    for name in ("flux", "qwenimage"):
        deps[name] = save_artefact(
            name,
            new_module(name, world),
            {"config": expected_config(name), "depends_on": {"text_encoder": te["sha256"]}},
            tmp_path,
        )["sha256"]
    judge = {"config": expected_config("attr_judge"), "depends_on": deps}
    save_artefact("attr_judge", new_module("attr_judge", world), judge, tmp_path)
    check_artefact("attr_judge", tmp_path)
    save_artefact(
        "attr_judge",
        new_module("attr_judge", world),
        judge | {"depends_on": deps | {"flux": "0" * 64}},
        tmp_path,
    )
    with pytest.raises(ArtefactError, match="different 'flux'"):
        check_artefact("attr_judge", tmp_path)
