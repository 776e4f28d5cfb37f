"""Real rewards (HPSv2.1, PickScore, CLIPScore) on tiny random-init models of the real classes, offline.

The scoring and preprocessing code is the production code; only the weights are random. Real weights never
load here (docs/decisions.md); requesting them offline must fail fast with a clear message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from jagg.errors import WeightsUnavailableError
from jagg.rewards import REWARDS, build_reward
from jagg.scale.rewards import (
    CLIP_MEAN,
    CLIP_STD,
    CLIPScoreReward,
    HPSv2Reward,
    PickScoreReward,
    clip_bpe_tokenizer,
    clip_preprocess,
)

IMG = 32  # tiny models' input size
PROMPTS = ["a red circle on the left", "a photo of a cat", "an astronaut riding a horse", "x"]


@pytest.fixture(scope="module")
def bpe():
    return clip_bpe_tokenizer()


def tiny_hf_clip(seed: int = 0):
    from transformers import CLIPConfig, CLIPModel

    text = dict(
        vocab_size=49408,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        eos_token_id=49407,
        bos_token_id=49406,
    )
    vision = dict(
        image_size=IMG,
        patch_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    torch.manual_seed(seed)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()


TINY_OPEN_CLIP = dict(
    embed_dim=16,
    vision_cfg=dict(image_size=IMG, layers=1, width=32, head_width=16, patch_size=8),
    text_cfg=dict(context_length=77, vocab_size=49408, width=32, heads=2, layers=1),
)


def tiny_open_clip(seed: int = 0):
    import open_clip

    torch.manual_seed(seed)
    return open_clip.model.CLIP(**TINY_OPEN_CLIP).eval()


def images(b: int = 4, h: int = 48, w: int = 40, seed: int = 0):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def rewards(bpe):
    import open_clip

    return {
        "hpsv2": HPSv2Reward.from_model(tiny_open_clip(), open_clip.get_tokenizer("ViT-H-14")),
        "pickscore": PickScoreReward.from_model(tiny_hf_clip(), bpe),
        "pickscore_flow_grpo": PickScoreReward.from_model(tiny_hf_clip(), bpe, scale="flow_grpo"),
        "clipscore": CLIPScoreReward.from_model(tiny_hf_clip(), bpe),
    }


def test_registered():
    for name in ("hpsv2", "pickscore", "clipscore"):
        assert name in REWARDS


def test_bpe_tokenizer_is_real(bpe):
    ids = bpe(["a photo of a cat"]).input_ids[0]
    assert ids[0] == 49406 and ids[-1] == 49407 and len(ids) == 7  # bos, 5 words, eos
    assert len(bpe) == 49408


def test_preprocess_resize_crop_normalise():
    x = torch.full((2, 3, 64, 48), 0.5)
    out = clip_preprocess(x, IMG)
    assert out.shape == (2, 3, IMG, IMG)
    expect = (0.5 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    torch.testing.assert_close(out[0, :, 5, 7], expect)
    # Centre crop of a portrait image: a stripe in the top 1/8 is cropped away entirely.
    y = torch.zeros(1, 3, 64, 32)
    y[:, :, :8] = 1.0
    assert torch.allclose(clip_preprocess(y, IMG), clip_preprocess(torch.zeros(1, 3, 64, 32), IMG))
    # Already the right size: only normalisation.
    z = torch.rand(1, 3, IMG, IMG)
    torch.testing.assert_close(
        clip_preprocess(z, IMG),
        (z - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1),
    )


@pytest.mark.parametrize("name", ["hpsv2", "pickscore", "pickscore_flow_grpo", "clipscore"])
def test_scores_shape_range_and_batch_invariance(rewards, name):
    fn = rewards[name]
    x = images()
    s = fn(x, PROMPTS)
    assert s.shape == (4,) and s.dtype == torch.float32 and torch.isfinite(s).all()
    one_by_one = torch.cat([fn(x[i : i + 1], PROMPTS[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(s, one_by_one, atol=1e-5, rtol=1e-5)
    fn.batch_size = 3  # chunking must not change anything either
    torch.testing.assert_close(fn(x, PROMPTS), s, atol=1e-5, rtol=1e-5)
    fn.batch_size = 32
    cos = fn.cosine(x, PROMPTS)
    assert (cos.abs() <= 1 + 1e-6).all()
    if name == "clipscore":
        torch.testing.assert_close(s, 100 * cos / 30)
        assert (s.abs() <= 100 / 30 + 1e-5).all()
    elif name == "pickscore_flow_grpo":
        torch.testing.assert_close(s, fn.model.logit_scale.exp() * cos / 26)
    else:
        torch.testing.assert_close(s, cos)


def test_scores_depend_on_prompt_and_image(rewards):
    x = images()
    for fn in rewards.values():
        s = fn(x, PROMPTS)
        assert not torch.allclose(s, fn(x, PROMPTS[::-1]))
        assert not torch.allclose(s, fn(images(seed=1), PROMPTS))


def test_any_resolution(rewards):
    for h, w in [(IMG, IMG), (64, 96), (17, 50)]:
        assert rewards["clipscore"](images(2, h, w), PROMPTS[:2]).shape == (2,)


def test_hpsv2_from_local_checkpoint(tmp_path, rewards):
    """The full constructor path: open_clip model by name + checkpoint file, as hpsv2 does internally."""
    import open_clip

    (tmp_path / "tiny-hps.json").write_text(json.dumps(TINY_OPEN_CLIP))
    open_clip.add_model_config(tmp_path / "tiny-hps.json")
    ref = rewards["hpsv2"]
    sd = {
        f"module.{k}": v for k, v in ref.model.state_dict().items()
    }  # DDP-saved, like the HPS training code
    torch.save({"state_dict": sd, "epoch": 1}, tmp_path / "hps.pt")
    for ckpt in (str(tmp_path / "hps.pt"), str(tmp_path)):  # the file, or a directory holding it
        fn = HPSv2Reward(checkpoint=ckpt, filename="hps.pt", arch="tiny-hps")
        torch.testing.assert_close(fn(images(), PROMPTS), ref(images(), PROMPTS))


@pytest.mark.parametrize("cls", [PickScoreReward, CLIPScoreReward])
def test_hf_reward_from_local_dir(tmp_path, bpe, cls):
    model = tiny_hf_clip(seed=3)
    model.save_pretrained(tmp_path / "m")
    bpe.save_pretrained(tmp_path / "m")
    if cls is PickScoreReward:
        fn = cls(model=str(tmp_path / "m"), processor=str(tmp_path / "m"), scale="logit")
        ref = cls.from_model(model, bpe, scale="logit")
    else:
        fn, ref = cls(model=str(tmp_path / "m")), cls.from_model(model, bpe)
    torch.testing.assert_close(fn(images(), PROMPTS), ref(images(), PROMPTS))


def test_bad_scale():
    with pytest.raises(ValueError, match="scale"):
        PickScoreReward(scale="nope")


@pytest.mark.parametrize("name", ["hpsv2", "pickscore", "clipscore"])
def test_offline_hub_id_fails_fast_in_process(monkeypatch, tmp_path, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # empty cache even on a machine that has the weights
    with pytest.raises(WeightsUnavailableError, match="HF_HUB_OFFLINE") as err:
        build_reward(name)
    assert "local path" in str(err.value)


def test_missing_local_path_is_clear():
    with pytest.raises(WeightsUnavailableError, match="local path does not exist"):
        CLIPScoreReward(model="/nonexistent/clip")


def test_offline_fails_fast_fresh_process(tmp_path):
    """A fresh interpreter with HF_HUB_OFFLINE=1 and an empty cache: a clear error, well inside a timeout."""
    code = (
        "import jagg.scale.rewards  # registers hpsv2, pickscore, clipscore\n"
        "from jagg.errors import WeightsUnavailableError\n"
        "from jagg.rewards import build_reward\n"
        "for n in ('hpsv2', 'pickscore', 'clipscore'):\n"
        "    try:\n        build_reward(n)\n    except WeightsUnavailableError as e:\n        print('OK', n, e)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("OK")]
    assert len(lines) == 3
    assert "xswu/HPSv2" in lines[0] and "yuvalkirstain/PickScore_v1" in lines[1]
    assert "openai/clip-vit-large-patch14" in lines[2]
