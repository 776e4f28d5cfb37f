"""HPSv3 on a tiny random-init Qwen2-VL of the real classes (transformers ``Qwen2VLForConditionalGeneration`` and
``Qwen2VLProcessor``), offline: the chat text, the 448 x 448 resize, the read-out at ``<|Reward|>``, batching,
a checkpoint in either key layout through the real constructor, the offline failure."""

from __future__ import annotations

import hashlib
import inspect

import pytest
import torch

from jagg.errors import WeightsUnavailableError
from jagg.rewards import REWARDS, build_reward
from jagg.scale.hpsv3 import (
    DTYPE,
    INSTRUCTION,
    PROMPT_WITH_SPECIAL_TOKEN,
    REWARD_TOKEN,
    HPSv3Reward,
    chat_text,
    convert_hpsv3_state_dict,
    hpsv3_scores,
    hpsv3_with_processor,
    resized_hw,
)

# SHA-256 of the UTF-8 bytes of hpsv3 1.0.0's hpsv3/dataset/data_collator_qwen.py INSTRUCTION (lines 11-32) and
# prompt_with_special_token (lines 38-42), computed from the sdist on PyPI (pip download --no-deps --no-binary :all:
# hpsv3==1.0.0; hpsv3-1.0.0.tar.gz sha256 42277f27...3f713c): the string literals read with ast.parse from the file,
# then hashlib.sha256(value.encode()).hexdigest(). `make hpsv3-ref` compares with the file itself.
INSTRUCTION_SHA256 = "0393599dad45a971903d1d62a3acf9bad3ccccdafa7f40f680523419e1f68b7a"
PROMPT_WITH_SPECIAL_TOKEN_SHA256 = "2471faca094ae5bd6fe17b71dce20c3d7583625545e235889f7e74e7eeb69d0a"
PROMPTS = ["a red circle on the left", "a photo of a cat", "an astronaut riding a horse"]
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
SPECIAL += ["<|video_pad|>"]


def tiny_processor():
    """A byte-level BPE with Qwen2-VL's special tokens, and Qwen2-VL's image processor (14-pixel patches, 2x2 merge)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([*PROMPTS, INSTRUCTION, PROMPT_WITH_SPECIAL_TOKEN], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", padding_side="right")
    images = Qwen2VLImageProcessor(min_pixels=256 * 28 * 28, max_pixels=256 * 28 * 28)
    return Qwen2VLProcessor(image_processor=images, tokenizer=fast, video_processor=Qwen2VLVideoProcessor())


def tiny_config(processor):
    from transformers import Qwen2VLConfig

    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            max_position_embeddings=4096,
            pad_token_id=ids["<pad>"],
        ),
        vision_config=dict(
            depth=1,
            embed_dim=32,
            hidden_size=32,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
    )


def tiny(seed: int = 0):
    processor = tiny_processor()
    config = tiny_config(processor)
    torch.manual_seed(seed)
    model = hpsv3_with_processor(config, processor).eval()
    with torch.no_grad():  # a head with larger weights, so that the scores of a random model spread
        for p in model.rm_head.parameters():
            p.normal_(0.0, 0.3)
    return model, processor, config


def images(b: int = 3, h: int = 48, w: int = 40, seed: int = 0):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def reward():
    model, processor, _ = tiny(seed=0)
    return HPSv3Reward.from_model(model, processor, dtype=torch.float32)


def test_registered():
    assert "hpsv3" in REWARDS


def test_instruction_is_hpsv3_1_0_0():
    """The instruction is hpsv3 1.0.0's, byte for byte (pinned hashes), with both of its sections: Visual Quality
    (five sub-dimensions) and Text Alignment (five more), then the prompt's slot."""
    assert hashlib.sha256(INSTRUCTION.encode()).hexdigest() == INSTRUCTION_SHA256
    assert hashlib.sha256(PROMPT_WITH_SPECIAL_TOKEN.encode()).hexdigest() == PROMPT_WITH_SPECIAL_TOKEN_SHA256
    assert len(INSTRUCTION) == 2523 and len(PROMPT_WITH_SPECIAL_TOKEN) == 67
    sections = ["**Visual Quality:**  \n", "**Text Alignment:**  \n", "Textual prompt - {text_prompt}\n\n\n"]
    at = [INSTRUCTION.index(s) for s in sections]
    assert at == sorted(at) and INSTRUCTION.endswith(sections[-1])
    visual, text = INSTRUCTION[at[0] : at[1]], INSTRUCTION[at[1] : at[2]]
    for name in [
        "Reasonableness:**",
        "Clarity:**",
        "Detail Richness:**",
        "Aesthetic and Creativity:**",
        "Safety:**",
    ]:
        assert f"- **{name}" in visual
    names = [
        "Subject Relevance**",
        "Style Relevance:**",
        "Contextual Consistency**:",
        "Attribute Fidelity**:",
    ]
    for name in [*names, "Semantic Coherence**:"]:
        assert f"- **{name}" in text
    assert (
        len(text) == 1205
    )  # the block the earlier copy lacked (1,206 characters with its blank line before)
    assert INSTRUCTION.format(text_prompt="a cat").endswith("Textual prompt - a cat\n\n\n")


def test_resize_and_chat_text():
    assert resized_hw(1024, 1024) == (448, 448) and resized_hw(16, 16) == (448, 448)
    for h, w in [(720, 1280), (48, 40), (512, 768), (17, 50)]:
        rh, rw = resized_hw(h, w)
        assert rh % 28 == 0 and rw % 28 == 0
        assert abs(rh * rw - 256 * 28 * 28) / (256 * 28 * 28) < 0.2
        assert abs(rh / rw - h / w) / (h / w) < 0.2
    text = chat_text("a cat")
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert "<|vision_start|><|image_pad|><|vision_end|>\nYou are tasked with evaluating" in text
    assert "Textual prompt - a cat\n" in text and text.count(REWARD_TOKEN) == 1
    assert text.count("**Text Alignment:**") == 1 and text.index("**Visual Quality:**") < text.index(
        "Text Alignment:"
    )
    assert text.endswith("<|Reward|>\n\nEND\n<|im_end|>\n<|im_start|>assistant\n")


def test_score_is_mu_at_the_reward_token(reward):
    """The processor expands the image placeholder to the merged patch count of the resized image (48 x 40 ->
    504 x 420: 36 x 30 patches, 270 tokens), the reward token appears once per row, and the score is output 0
    of the head there."""
    x = images()
    batch = reward._inputs(x, PROMPTS)
    assert resized_hw(48, 40) == (504, 420) and batch.image_grid_thw.tolist() == [[1, 36, 30]] * 3
    image_id = reward.model.config.image_token_id
    assert ((batch.input_ids == image_id).sum(-1) == 270).all()
    both = hpsv3_scores(
        reward.model, batch.input_ids, batch.attention_mask, batch.pixel_values, batch.image_grid_thw
    )
    assert both.shape == (3, 2)
    s = reward(x, PROMPTS)
    assert s.shape == (3,) and s.dtype == torch.float32 and torch.isfinite(s).all()
    torch.testing.assert_close(s, both[:, 0])


def test_batch_invariance_and_inputs(reward):
    x = images()
    s = reward(x, PROMPTS)
    one_by_one = torch.cat([reward(x[i : i + 1], PROMPTS[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(s, one_by_one, atol=1e-4, rtol=1e-4)  # right padding changes nothing
    reward.batch_size = 2
    torch.testing.assert_close(reward(x, PROMPTS), s, atol=1e-4, rtol=1e-4)
    reward.batch_size = 8
    assert not torch.allclose(s, reward(x, PROMPTS[::-1]), atol=1e-3)
    assert not torch.allclose(s, reward(0.3 * images(seed=1), PROMPTS), atol=1e-3)
    assert reward(images(2, 64, 96), PROMPTS[:2]).shape == (2,)
    with pytest.raises(ValueError, match="3 images but 2 prompts"):
        reward(x, PROMPTS[:2])


@pytest.mark.parametrize("layout", ["transformers5", "legacy"])
def test_from_local_checkpoint(tmp_path, layout):
    """The real constructor: the base's config and processor from a local folder, HPSv3.safetensors in either key
    layout (saved before / after transformers 4.52), loaded strictly; equal scores on images it has not seen."""
    from safetensors.torch import save_file

    model, processor, config = tiny(seed=2)
    base = tmp_path / "qwen2vl"
    config.save_pretrained(base)
    tiny_processor().save_pretrained(
        base
    )  # without <|Reward|>: the constructor adds it, as create_model_and_processor
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if layout == "legacy":
        state = {
            k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
            for k, v in state.items()
        }
    assert convert_hpsv3_state_dict(state).keys() == model.state_dict().keys()
    save_file(state, tmp_path / "HPSv3.safetensors")
    fn = HPSv3Reward(checkpoint=str(tmp_path / "HPSv3.safetensors"), base=str(base), dtype=torch.float32)
    ref = HPSv3Reward.from_model(model, processor, dtype=torch.float32)
    x = images(seed=7)
    torch.testing.assert_close(fn(x, PROMPTS), ref(x, PROMPTS))


def test_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(WeightsUnavailableError, match="HF_HUB_OFFLINE") as err:
        build_reward("hpsv3")
    assert "MizzenAI/HPSv3" in str(err.value) and "local path" in str(err.value)
    with pytest.raises(WeightsUnavailableError, match="local path does not exist"):
        HPSv3Reward(checkpoint=str(tmp_path / "HPSv3.safetensors"), base="/nonexistent/qwen2vl")


def test_dry_run_plan_counts_hpsv3_and_imagereward():
    """The memory plan holds both reward models resident on every rank, in their configured dtype (HPSv3 in bf16
    here, ImageReward in the default fp32), counted from their architectures on the meta device."""
    from jagg.capacity.memory_model import memory_plan
    from jagg.capacity.pass_plan import trained_steps_per_sample
    from jagg.config import load_config
    from jagg.scale.architectures import AUX_MODELS, aux_params

    cfg = load_config(
        "configs/paper/flux_dancegrpo.yaml",
        [
            "reward.weights={hpsv3: 1.0, imagereward: 0.5}",
            "reward.kwargs={hpsv3: {dtype: bf16}}",
            "algorithm.adv_aggregation=per_reward",
        ],
    )
    setting = cfg.backward.fixed_setting()
    cost = setting.cost(trained_steps_per_sample(cfg))
    gpu = memory_plan(cfg, 8, cost.graphs_alive, False).gpu
    assert gpu[AUX_MODELS["hpsv3"][0]] == 2 * aux_params("hpsv3")
    assert gpu[AUX_MODELS["imagereward"][0]] == 4 * aux_params("imagereward")
    assert aux_params("hpsv3") == 8_291_375_616 + 2 * 3584 + (
        3584 * 1024 + 1024 + 1024 * 16 + 16 + 16 * 2 + 2
    )


def test_bf16_by_default_built_in_bf16(tmp_path):
    """HPSv3's dtype by default (HPSv3_7B.yaml: bf16; create_model_and_processor: the head float32): the real
    constructor creates every parameter of the model in bf16 (no float32 copy first), the head in float32, and
    scores as the float32 model cast to bf16 does; torch's default dtype is restored."""
    from safetensors.torch import save_file
    from torch.nn.modules.module import register_module_parameter_registration_hook

    assert torch.bfloat16 == DTYPE
    for fn in (HPSv3Reward.__init__, HPSv3Reward._init_from):
        assert inspect.signature(fn).parameters["dtype"].default == torch.bfloat16
    model, processor, config = tiny(seed=3)
    base = tmp_path / "qwen2vl"
    config.save_pretrained(base)
    tiny_processor().save_pretrained(base)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "HPSv3.safetensors")
    created = []
    hook = register_module_parameter_registration_hook(lambda m, n, p: created.append((m, n, p.dtype)))
    try:
        fn = HPSv3Reward(checkpoint=str(tmp_path / "HPSv3.safetensors"), base=str(base))
    finally:
        hook.remove()
    assert torch.get_default_dtype() == torch.float32
    head = set(fn.model.rm_head.modules())
    body = [(n, d) for m, n, d in created if m not in head]
    assert len(body) > 20 and {d for _, d in body} == {torch.bfloat16}
    assert {d for m, _, d in created if m in head} == {torch.float32}
    assert {p.dtype for p in fn.model.rm_head.parameters()} == {torch.float32}
    assert {p.dtype for n, p in fn.model.named_parameters() if not n.startswith("rm_head")} == {
        torch.bfloat16
    }
    ref = HPSv3Reward.from_model(model, processor)  # the float32 model, cast (the reference's model.to(bf16))
    assert next(ref.model.model.parameters()).dtype == torch.bfloat16
    x = images(seed=5)
    s = fn(x, PROMPTS)
    assert s.dtype == torch.float32 and torch.isfinite(s).all()
    torch.testing.assert_close(s, ref(x, PROMPTS), atol=0, rtol=0)


def test_dry_run_plan_counts_hpsv3_in_its_default_bf16():
    """Without ``reward.kwargs``, the memory plan counts HPSv3 in its default bf16 (2 bytes per parameter), fp32
    when configured so, and the other rewards in fp32."""
    from jagg.capacity.memory_model import memory_plan
    from jagg.capacity.pass_plan import trained_steps_per_sample
    from jagg.config import load_config
    from jagg.scale.architectures import AUX_MODELS, aux_params

    def plan(*extra):
        cfg = load_config(
            "configs/paper/flux_dancegrpo.yaml",
            ["reward.weights={hpsv3: 1.0, pickscore: 0.5}", *extra],
        )
        cost = cfg.backward.fixed_setting().cost(trained_steps_per_sample(cfg))
        return memory_plan(cfg, 8, cost.graphs_alive, False).gpu

    default, fp32 = plan(), plan("reward.kwargs={hpsv3: {dtype: fp32}}")
    assert default[AUX_MODELS["hpsv3"][0]] == 2 * aux_params("hpsv3")
    assert fp32[AUX_MODELS["hpsv3"][0]] == 4 * aux_params("hpsv3")
    assert default[AUX_MODELS["pickscore"][0]] == 4 * aux_params("pickscore")


class _CountingSafeOpen:
    """Stands in for ``safetensors.safe_open``: hands out fresh host copies (as a safetensors that copies out
    of its mapping would) and counts the bytes alive at once."""

    alive = peak = 0

    def __init__(self, path, framework="pt", device="cpu", **kwargs):
        self.f = _REAL_SAFE_OPEN(path, framework=framework, device=device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return self.f.keys()

    def metadata(self):
        return self.f.metadata()

    def get_tensor(self, key):
        import weakref

        t = self.f.get_tensor(key).clone()
        n = t.numel() * t.element_size()
        cls = type(self)
        cls.alive += n
        cls.peak = max(cls.peak, cls.alive)
        weakref.finalize(t, lambda: setattr(cls, "alive", cls.alive - n))
        return t

    def get_tensors(self):
        return {k: self.get_tensor(k) for k in self.keys()}


import safetensors  # noqa: E402

_REAL_SAFE_OPEN = safetensors.safe_open


def _saved(tmp_path, seed: int, fmt: str = "safetensors", **save_kwargs):
    from safetensors.torch import save_file

    model, processor, config = tiny(seed=seed)
    base = tmp_path / "qwen2vl"
    config.save_pretrained(base)
    tiny_processor().save_pretrained(base)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    path = tmp_path / f"HPSv3.{fmt}"
    if fmt == "safetensors":
        save_file(state, path)
    else:
        torch.save({"model": state}, path, **save_kwargs)
    return model, processor, base, path, state


def test_checkpoint_is_read_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The real constructor copies HPSv3.safetensors into the model tensor by tensor (``load_streamed``): at most
    one checkpoint tensor is held outside the mapping at a time, never the state dict (the old
    ``load_file`` asked for every tensor at once: 16.6 GB per rank). Scores equal the model saved."""
    import safetensors.torch

    model, processor, base, path, state = _saved(tmp_path, seed=4)
    monkeypatch.setattr(_CountingSafeOpen, "alive", 0)
    monkeypatch.setattr(_CountingSafeOpen, "peak", 0)
    monkeypatch.setattr(safetensors, "safe_open", _CountingSafeOpen)
    monkeypatch.setattr(safetensors.torch, "safe_open", _CountingSafeOpen)
    fn = HPSv3Reward(checkpoint=str(path), base=str(base), dtype=torch.float32)
    sizes = [v.numel() * v.element_size() for v in state.values()]
    assert 0 < _CountingSafeOpen.peak <= max(sizes) < sum(sizes) / 4
    ref = HPSv3Reward.from_model(model, processor, dtype=torch.float32)
    x = images(seed=8)
    torch.testing.assert_close(fn(x, PROMPTS), ref(x, PROMPTS))


@pytest.mark.parametrize("zipfile", [True, False])
def test_pt_checkpoint_is_memory_mapped(tmp_path, monkeypatch, zipfile):
    """A ``.pt`` checkpoint ({"model": state}) is opened with ``torch.load(mmap=True)``; a legacy (non-zip) file,
    which cannot be mapped, is read whole instead. Either loads strictly to the same scores."""
    model, processor, base, path, _ = _saved(
        tmp_path, seed=5, fmt="pt", _use_new_zipfile_serialization=zipfile
    )
    calls, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw.get("mmap")) or real_load(*a, **kw))
    fn = HPSv3Reward(checkpoint=str(path), base=str(base), dtype=torch.float32)
    assert calls == ([True] if zipfile else [True, None])
    ref = HPSv3Reward.from_model(model, processor, dtype=torch.float32)
    x = images(seed=9)
    torch.testing.assert_close(fn(x, PROMPTS), ref(x, PROMPTS))


def test_streamed_load_is_strict(tmp_path):
    from safetensors.torch import save_file

    from jagg.scale.hpsv3 import load_streamed

    model, _, _ = tiny(seed=6)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    key = next(k for k in state if k.startswith("rm_head"))
    save_file({k: v for k, v in state.items() if k != key}, tmp_path / "missing.safetensors")
    with pytest.raises(RuntimeError, match="missing keys"):
        load_streamed(model, str(tmp_path / "missing.safetensors"))
    save_file({**state, key: torch.zeros(3, 3)}, tmp_path / "shape.safetensors")
    with pytest.raises(RuntimeError, match=r"has shape \(3, 3\)"):
        load_streamed(model, str(tmp_path / "shape.safetensors"))


def test_memory_plan_counts_hpsv3_on_the_gpu_and_its_streamed_load_on_the_host():
    """Every rank: HPSv3's weights on its GPU (bf16: 2 bytes per parameter), and while loading on the host only its
    largest tensor (the token embedding), not the model; a node's host total counts its own ranks, not the job's
    (16 ranks on 2 nodes of 8)."""
    from jagg.capacity.memory_model import HOST_BASELINE, memory_plan
    from jagg.capacity.pass_plan import trained_steps_per_sample
    from jagg.config import load_config
    from jagg.scale.architectures import AUX_MODELS, aux_largest_tensor, aux_params

    base = ["reward.kwargs={}", "log.async_checkpoint=false", "data.precompute_embeddings=false"]
    plans = {}
    for reward in ("hpsv3", "jpeg"):
        cfg = load_config(
            "configs/paper/flux_dancegrpo.yaml",
            [*base, f"reward.weights={{{reward}: 1.0}}", f"reward.eval=[{reward}]"],
        )
        cost = cfg.backward.fixed_setting().cost(trained_steps_per_sample(cfg))
        plans[reward] = memory_plan(cfg, 16, cost.graphs_alive, False)
    gpu, host = plans["hpsv3"].gpu, plans["hpsv3"].host
    assert gpu[AUX_MODELS["hpsv3"][0]] == 2 * aux_params("hpsv3")
    assert AUX_MODELS["hpsv3"][0] not in plans["jpeg"].gpu
    assert aux_largest_tensor("hpsv3") == (152064 + 1) * 3584  # embed_tokens (lm_head the same)
    # the largest staged model is Flux's T5-XXL (8.9 GiB in bf16) either way: HPSv3 (15.5 GiB) adds nothing
    assert host == plans["jpeg"].host
    assert host["other ranks"] < HOST_BASELINE + 2 * aux_params("hpsv3")  # the old plan: the whole model
    node = plans["hpsv3"].node_host(8)
    assert node["node 0"] == host["rank 0"] + 7 * host["other ranks"]
    assert node["other nodes"] == 8 * host["other ranks"]
