"""ImageReward on a tiny random-init model of the real classes (transformers BLIP), offline: a checkpoint written
in ImageReward.pt's own key layout loads strictly through the real constructor; batching, chunking and inputs;
the offline failure."""

from __future__ import annotations

import json

import pytest
import torch

from jagg.errors import WeightsUnavailableError
from jagg.rewards import REWARDS, build_reward
from jagg.scale.imagereward import (
    IMAGEREWARD_MEAN,
    IMAGEREWARD_STD,
    ImageRewardModel,
    ImageRewardReward,
    add_blip_tokens,
    convert_imagereward_state_dict,
)

IMG = 32
PROMPTS = ["a red circle on the left", "a photo of a cat", "an astronaut riding a horse", "x"]
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS += [
    "a",
    "red",
    "circle",
    "on",
    "the",
    "left",
    "photo",
    "of",
    "cat",
    "an",
    "astronaut",
    "riding",
    "horse",
    "x",
]
# med_config.json's BERT keys, shrunk (the real one: hidden 768, 12 layers, 12 heads, vocab 30524)
TINY_MED = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=64,
    layer_norm_eps=1e-12,
    hidden_act="gelu",
    pad_token_id=0,
    add_cross_attention=True,
    initializer_range=0.5,  # real: 0.02; larger so that a random model's score depends visibly on the image
)
TINY_VIT = dict(
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=IMG,
    patch_size=8,
    layer_norm_eps=1e-6,
    initializer_range=0.5,
)


def tiny_tokenizer():
    from transformers import BertTokenizer

    return add_blip_tokens(BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)}))


def tiny_model(seed: int = 0) -> ImageRewardModel:
    torch.manual_seed(seed)
    med = {**TINY_MED, "vocab_size": len(WORDS) + 2}  # + [DEC], [ENC]
    model = ImageRewardModel.from_med_config(med, vision=TINY_VIT).eval()
    with torch.no_grad():  # a head with larger weights, so that the scores of a random model spread
        for p in model.mlp.parameters():
            p.normal_(0.0, 0.3)
    return model


def reference_layout(model: ImageRewardModel) -> dict[str, torch.Tensor]:
    """The model's weights under ImageReward.pt's key names, spelled out from ImageReward's modules
    (``models/BLIP/vit.py`` : ``VisionTransformer``, ``Block``, ``Attention``, ``Mlp``; ``models/BLIP/med.py`` :
    ``BertModel``; ``ImageReward.py`` : ``MLP``), plus the BLIP weights the score does not use."""
    sd = model.state_dict()
    v, d = "vision_model.", "blip.visual_encoder."
    out = {
        d + "cls_token": sd[v + "embeddings.class_embedding"],
        d + "pos_embed": sd[v + "embeddings.position_embedding"],
        d + "patch_embed.proj.weight": sd[v + "embeddings.patch_embedding.weight"],
        d + "patch_embed.proj.bias": sd[v + "embeddings.patch_embedding.bias"],
        d + "norm.weight": sd[v + "post_layernorm.weight"],
        d + "norm.bias": sd[v + "post_layernorm.bias"],
    }
    for i in range(TINY_VIT["num_hidden_layers"]):
        ours = f"{v}encoder.layers.{i}."
        for theirs, name in [
            ("norm1", "layer_norm1"),
            ("norm2", "layer_norm2"),
            ("attn.qkv", "self_attn.qkv"),
            ("attn.proj", "self_attn.projection"),
            ("mlp.fc1", "mlp.fc1"),
            ("mlp.fc2", "mlp.fc2"),
        ]:
            for p in ("weight", "bias"):
                out[f"{d}blocks.{i}.{theirs}.{p}"] = sd[f"{ours}{name}.{p}"]
    out |= {"blip." + k: t for k, t in sd.items() if k.startswith("text_encoder.")}  # med.py's names
    out |= {"mlp.layers." + k.removeprefix("mlp."): t for k, t in sd.items() if k.startswith("mlp.")}
    out["blip.text_encoder.embeddings.position_ids"] = torch.arange(64).unsqueeze(0)
    out["blip.vision_proj.weight"] = torch.zeros(256, TINY_VIT["hidden_size"])
    out["blip.text_proj.weight"] = torch.zeros(256, TINY_MED["hidden_size"])
    return out


def images(b: int = 4, h: int = 48, w: int = 40, seed: int = 0):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def reward():
    return ImageRewardReward.from_model(tiny_model(), tiny_tokenizer())


def test_registered():
    assert "imagereward" in REWARDS


def test_checkpoint_layout_converts_to_every_weight():
    model = tiny_model()
    converted = convert_imagereward_state_dict(reference_layout(model))
    assert set(converted) == set(model.state_dict())  # nothing missing, nothing left over
    for k, t in model.state_dict().items():
        assert torch.equal(converted[k], t), k
    with pytest.raises(KeyError, match="no rule for the ViT key"):
        convert_imagereward_state_dict({"blip.visual_encoder.blocks.0.ls1.gamma": torch.zeros(1)})


def test_score_is_the_normalised_head_on_the_cls_token(reward):
    """The score: the MLP head on the text encoder's [CLS] output, cross-attending to every ViT token, normalised
    by ImageReward's mean / std; the tokens are padded to 35 and start with [CLS]."""
    x = images()
    s = reward(x, PROMPTS)
    assert s.shape == (4,) and s.dtype == torch.float32 and torch.isfinite(s).all()
    model, tok = (
        reward.model,
        reward.tokenizer(PROMPTS, padding="max_length", max_length=35, return_tensors="pt"),
    )
    assert tok.input_ids.shape == (4, 35) and (tok.input_ids[:, 0] == WORDS.index("[CLS]")).all()
    from jagg.scale.rewards import clip_preprocess

    pixels = clip_preprocess(x, IMG)
    img = model.vision_model(pixel_values=pixels).last_hidden_state
    assert img.shape == (4, 1 + (IMG // 8) ** 2, TINY_VIT["hidden_size"])
    txt = model.text_encoder(
        input_ids=tok.input_ids,
        attention_mask=tok.attention_mask,
        encoder_hidden_states=img,
        encoder_attention_mask=torch.ones(img.shape[:2], dtype=torch.long),
    ).last_hidden_state[:, 0]
    expected = (model.mlp(txt).squeeze(-1) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD
    torch.testing.assert_close(s, expected)


def test_batch_invariance_and_inputs(reward):
    x = images()
    s = reward(x, PROMPTS)
    one_by_one = torch.cat([reward(x[i : i + 1], PROMPTS[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(s, one_by_one, atol=1e-5, rtol=1e-5)
    reward.batch_size = 3
    torch.testing.assert_close(reward(x, PROMPTS), s, atol=1e-5, rtol=1e-5)
    reward.batch_size = 32
    assert not torch.allclose(s, reward(x, PROMPTS[::-1]), atol=1e-3)
    assert not torch.allclose(s, reward(0.3 * images(seed=1), PROMPTS), atol=1e-3)
    for h, w in [(IMG, IMG), (64, 96), (17, 50)]:
        assert reward(images(2, h, w), PROMPTS[:2]).shape == (2,)
    with pytest.raises(ValueError, match="4 images but 3 prompts"):
        reward(x, PROMPTS[:3])


def test_from_local_checkpoint(tmp_path, reward):
    """The real constructor: ImageReward.pt (their key layout) + med_config.json from a directory or the file,
    the tokenizer from a local folder; scores equal the in-memory model's on images it has not seen."""
    model = tiny_model()
    torch.save(reference_layout(model), tmp_path / "ImageReward.pt")
    (tmp_path / "med_config.json").write_text(json.dumps({**TINY_MED, "vocab_size": len(WORDS) + 2}))
    from transformers import BertTokenizer

    BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)}).save_pretrained(tmp_path / "bert")
    ref = ImageRewardReward.from_model(model, tiny_tokenizer())
    x = images(seed=5)
    for ckpt in (str(tmp_path), str(tmp_path / "ImageReward.pt")):
        fn = ImageRewardReward(checkpoint=ckpt, tokenizer=str(tmp_path / "bert"), vision=TINY_VIT)
        torch.testing.assert_close(fn(x, PROMPTS), ref(x, PROMPTS))
    other = tiny_model(seed=1)  # a different checkpoint scores differently
    torch.save(reference_layout(other), tmp_path / "ImageReward.pt")
    fn = ImageRewardReward(checkpoint=str(tmp_path), tokenizer=str(tmp_path / "bert"), vision=TINY_VIT)
    assert not torch.allclose(fn(x, PROMPTS), ref(x, PROMPTS))


def test_offline_hub_id_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(WeightsUnavailableError, match="HF_HUB_OFFLINE") as err:
        build_reward("imagereward")
    assert "THUDM/ImageReward" in str(err.value) and "local path" in str(err.value)
    with pytest.raises(WeightsUnavailableError, match="local path does not exist"):
        ImageRewardReward(checkpoint="/nonexistent/imagereward")


def test_full_size_shapes_match_imagereward():
    """The default model (ViT-L/16 at 224, ``med_config.json`` of ImageReward's training code) built on the meta
    device: the shapes ImageReward.pt's weights have (from ``create_vit("large")``, ``BertModel`` with
    ``encoder_width`` 1024 and ``MLP(768)``), 24 ViT blocks and 12 BERT layers."""
    med = dict(
        hidden_act="gelu",
        hidden_size=768,
        initializer_range=0.02,
        intermediate_size=3072,
        layer_norm_eps=1e-12,
        max_position_embeddings=512,
        num_attention_heads=12,
        num_hidden_layers=12,
        pad_token_id=0,
        vocab_size=30524,
        encoder_width=768,
        add_cross_attention=True,
    )
    from jagg.scale.imagereward import MED_CONFIG

    assert med == MED_CONFIG  # the values of ImageReward's med_config.json
    with torch.device("meta"):
        model = ImageRewardModel.from_med_config(med)
    sd = model.state_dict()
    shapes = {
        "vision_model.embeddings.position_embedding": (1, 197, 1024),
        "vision_model.embeddings.patch_embedding.weight": (1024, 3, 16, 16),
        "vision_model.encoder.layers.23.self_attn.qkv.weight": (3072, 1024),
        "vision_model.encoder.layers.23.mlp.fc1.weight": (4096, 1024),
        "text_encoder.embeddings.word_embeddings.weight": (30524, 768),
        "text_encoder.encoder.layer.11.crossattention.self.key.weight": (768, 1024),
        "mlp.0.weight": (1024, 768),
        "mlp.7.weight": (1, 16),
    }
    for key, shape in shapes.items():
        assert tuple(sd[key].shape) == shape, key
    assert "vision_model.encoder.layers.24.layer_norm1.weight" not in sd
    assert "text_encoder.encoder.layer.12.output.dense.weight" not in sd
    assert (
        model.vision_model.config.layer_norm_eps == 1e-6
    )  # timm-style ViT of BLIP (transformers default 1e-5)
