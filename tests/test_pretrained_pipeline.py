"""model.source=pretrained end to end, offline: tiny random-init FLUX.1-dev / Qwen-Image pipelines of the real
classes (transformer, VAE, text encoders, tokenizers, scheduler) saved with ``save_pretrained`` and loaded
through the real code path (``jagg.scale.pretrained.build_pretrained_components``) for 2 training iterations.

Tokenizers: CLIP-L gets the real CLIP BPE (open_clip's bundled vocab, docs/decisions.md); T5 and Qwen2.5-VL
get a tiny byte-level BPE trained with the ``tokenizers`` library (their real vocabularies need the hub).
"""

from __future__ import annotations

import pytest
import torch

from jagg.config import load_config
from jagg.loop.components import build_components
from jagg.loop.trainer import Trainer
from jagg.models import build_tiny_backbone
from jagg.ops.checkpoint import read_checkpoint
from jagg.rewards import REWARDS
from jagg.scale import tiny_pipeline
from jagg.scale.pipelines import CachedTextEncoder, VaeDecoder

PROMPTS = [
    "a red circle on the left",
    "a photo of a cat on a sofa",
    "a blue square above a green triangle",
    "an astronaut riding a horse",
]


def tiny_bpe(max_length: int = 64):
    """A 300-token byte-level BPE with the special tokens the Qwen chat template uses."""
    texts = PROMPTS + ["Describe the image by detailing the color, shape, size"]
    specials = ("<pad>", "</s>", "<|im_start|>", "<|im_end|>")
    return tiny_pipeline.tiny_bpe(texts, specials, model_max_length=max_length)


def save_flux_pipeline(root) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from jagg.scale.rewards import clip_bpe_tokenizer

    torch.manual_seed(0)
    build_tiny_backbone("flux", seed=1).transformer.save_pretrained(root / "transformer")
    FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15
    ).save_config(root / "scheduler")
    AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        latent_channels=16,
        norm_num_groups=4,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    ).save_pretrained(root / "vae")
    clip_cfg = CLIPTextConfig(
        vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    CLIPTextModel(clip_cfg).save_pretrained(root / "text_encoder")
    clip_bpe_tokenizer().save_pretrained(root / "tokenizer")
    t5_cfg = T5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    T5EncoderModel(t5_cfg).save_pretrained(root / "text_encoder_2")
    tiny_bpe().save_pretrained(root / "tokenizer_2")


def save_qwenimage_pipeline(root) -> None:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    build_tiny_backbone("qwenimage", seed=1).transformer.save_pretrained(root / "transformer")
    FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        shift_terminal=0.02,
        time_shift_type="exponential",
    ).save_config(root / "scheduler")
    AutoencoderKLQwenImage(
        base_dim=8, z_dim=16, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False]
    ).save_pretrained(root / "vae")
    text = dict(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_scaling={"type": "mrope", "mrope_section": [4, 2, 2]},
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(root / "text_encoder")
    tiny_bpe().save_pretrained(root / "tokenizer")


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    save_flux_pipeline(root / "flux")
    save_qwenimage_pipeline(root / "qwenimage")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return root


class RandomReward:
    """A tiny random reward (deterministic in the images): a fixed random projection of the pixels."""

    def __call__(self, images, prompts):
        g = torch.Generator().manual_seed(0)
        w = torch.randn(images[0].numel(), generator=g)
        return images.flatten(1).float() @ w / images[0].numel() ** 0.5


@pytest.fixture(autouse=True)
def _random_reward(monkeypatch):
    monkeypatch.setitem(REWARDS, "random_test", lambda device=None: RandomReward())


def tiny_pretrained_cfg(pipelines, tmp_path, backbone, algorithm, *overrides):
    return load_config(
        f"configs/paper/{backbone}_{algorithm}.yaml",
        [
            f"model.path={pipelines / backbone}",
            "model.max_sequence_length=16",
            "model.gradient_checkpointing=false",
            "sampling.latent_size=8",
            "sampling.num_steps=4",
            "sampling.eval_num_steps=3",
            "algorithm.sde_window_range=[0, 3]",
            "algorithm.clip_range=0.2",
            "train.device=cpu",
            "train.precision=fp32",
            "train.iterations=2",
            "train.prompts_per_iter=2",
            "train.images_per_prompt=2",
            "train.train_batch_size=2",
            "train.grad_accum=1",
            "optim.lr=1e-3",
            "reward.weights={random_test: 1.0}",
            "reward.eval=[random_test]",
            "reward.kwargs={}",
            f"data.train_prompts={pipelines / 'prompts.txt'}",
            f"data.eval_prompts={pipelines / 'prompts.txt'}",
            "data.eval_limit=null",
            "log.eval_every=2",
            "log.eval_prompts=2",
            f"log.run_dir={tmp_path}",
            *overrides,
        ],
    )


CASES = [
    ("flux", "dancegrpo"),
    ("qwenimage", "dancegrpo"),
    ("flux", "flowgrpo_fast"),
    ("qwenimage", "flowgrpo_fast"),
]


@pytest.mark.parametrize(("backbone", "algorithm"), CASES)
def test_pretrained_pipeline_trains_two_iterations(pipelines, tmp_path, backbone, algorithm):
    # full fine-tuning of the tiny pipeline: nothing frozen, so nothing to replicate
    overrides = ("model.lora_rank=0", "model.shard_frozen_base=true")
    cfg = tiny_pretrained_cfg(pipelines, tmp_path, backbone, algorithm, *overrides)
    comp = build_components(cfg)
    assert isinstance(comp.text_encoder, CachedTextEncoder) and isinstance(comp.decode, VaeDecoder)
    cond = comp.text_encoder.encode_prompts(PROMPTS[:2])
    if backbone == "flux":
        assert cond.embeds.shape == (2, 16, 32) and cond.pooled.shape == (2, 32)  # T5 padded, CLIP pooled
    else:
        assert cond.mask is not None and cond.mask.shape == cond.embeds.shape[:2]
        assert (cond.neg_embeds is not None) == (cfg.model.true_cfg_scale > 1)
    images = comp.decode(torch.randn(3, 16, 8, 8))
    assert images.shape == (3, 3, 16, 16) and images.min() >= 0 and images.max() <= 1
    if cfg.sampling.schedule == "scheduler":  # the pipeline's own scheduler (Flow-GRPO configs)
        assert comp.sigmas.shape == (5,) and comp.eval_sigmas.shape == (4,) and comp.sigmas[-1] == 0
    trainer = Trainer(cfg, comp, tmp_path)
    before = [p.detach().clone() for p in trainer.params]
    metrics = trainer.fit()
    assert [m["iteration"] for m in metrics] == [0, 1, 2]  # evaluation before training, then 2 iterations
    assert all(m["onpolicy_ratio_max_dev"] == 0.0 and m["skipped_steps"] == 0 for m in metrics[1:])
    assert "eval_random_test_mean" in metrics[-1]
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.params))
    assert (tmp_path / "checkpoint" / ".metadata").is_file()
    assert (tmp_path / "samples" / "iter_00002.png").is_file()


@pytest.mark.parametrize("backbone", ["flux", "qwenimage"])
def test_lora_run_changes_only_adapters(pipelines, tmp_path, backbone):
    cfg = tiny_pretrained_cfg(
        pipelines, tmp_path, backbone, "flowgrpo_fast", "model.lora_rank=4", "model.lora_alpha=8"
    )
    trainer = Trainer(cfg, build_components(cfg), tmp_path)
    named = dict(trainer.backbone.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainer.params) == len(trainable)  # only adapters reach the optimizer
    before = {n: p.detach().clone() for n, p in named.items()}
    trainer.fit()
    changed = {n for n, p in named.items() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    state = read_checkpoint(tmp_path / "checkpoint")
    assert {k.removeprefix("model.") for k in state if k.startswith("model.")} == trainable  # adapters only


def test_embedding_cache_precompute_and_release(pipelines, tmp_path):
    cache = tmp_path / "emb"
    cfg = tiny_pretrained_cfg(
        pipelines,
        tmp_path / "run",
        "qwenimage",
        "flowgrpo_fast",
        f"data.embedding_cache={cache}",
        "data.precompute_embeddings=true",
    )
    comp = build_components(cfg)
    assert comp.text_encoder.encoder is None  # released after precomputing every train/eval prompt
    assert len(list(cache.glob("*.pt"))) == len(PROMPTS)
    cond = comp.text_encoder.encode_prompts([PROMPTS[1], PROMPTS[0], PROMPTS[1]])
    assert cond.batch_size == 3 and torch.equal(cond.embeds[0], cond.embeds[2])
    with pytest.raises(RuntimeError, match="not in the embedding cache"):
        comp.text_encoder.encode_prompts(["an unseen prompt"])
    # cached rows equal a fresh encoding of the same batch (padding to the longest prompt included)
    fresh = CachedTextEncoder(
        build_components(
            tiny_pretrained_cfg(pipelines, tmp_path / "b", "qwenimage", "flowgrpo_fast")
        ).text_encoder.encoder
    )
    ref = fresh.encoder.encode_prompts([PROMPTS[1], PROMPTS[0], PROMPTS[1]])
    torch.testing.assert_close(cond.embeds, ref.embeds)
    torch.testing.assert_close(cond.mask, ref.mask)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backbone", ["flux", "qwenimage"])
def test_pretrained_pipeline_bf16_on_gpu(pipelines, tmp_path, backbone):
    """The same tiny run on CUDA under bf16 autocast (fp32 master weights, fp32 log-probs), with LoRA."""
    cfg = tiny_pretrained_cfg(
        pipelines,
        tmp_path,
        backbone,
        "flowgrpo_fast",
        "train.device=cuda",
        "train.precision=bf16",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "model.gradient_checkpointing=true",
    )
    metrics = Trainer(cfg, build_components(cfg), tmp_path).fit()
    for m in metrics[1:]:
        assert m["skipped_steps"] == 0 and torch.isfinite(torch.tensor(m["grad_norm"]))
        assert m["onpolicy_ratio_max_dev"] < 1e-3


def test_cli_hub_id_offline_fails_fast(tmp_path, monkeypatch, capsys):
    from jagg.train import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/paper/flux_dancegrpo.yaml", "train.device=cpu", f"log.run_dir={run_dir}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "black-forest-labs/FLUX.1-dev" in err and "HF_HUB_OFFLINE" in err and len(err.splitlines()) == 1
    assert not run_dir.exists()
