"""Our HPSv3 scorer's prompt, chat turn, resize and head against the ``hpsv3`` 1.0.0 source distribution itself.

The ``hpsv3`` package is not importable here (it pins trl, deepspeed, flash-attn era dependencies), so this test
reads its files from the sdist that ``make hpsv3-ref`` downloads without dependencies into ``cache/hpsv3``
(``pip download --no-deps --no-binary :all: hpsv3==1.0.0``) and runs the pieces that matter on their own: the
string constants of ``hpsv3/dataset/data_collator_qwen.py``, ``HPSv3RewardInferencer.prepare_batch``
(``hpsv3/inference.py``) with a recording processor, ``smart_resize`` (``hpsv3/dataset/utils.py``), and
``Qwen2VLRewardModelBT.__init__``'s head (``hpsv3/model/qwen2vl_trainer.py``) on a stand-in base class. Skipped
when the sdist is absent, so that CI never needs the network. Qwen2-VL-Instruct's chat template itself (the
system turn and the ``<|im_start|>`` framing) comes with the base model's processor on the hub, not with
``hpsv3``; it is not compared here.
"""

from __future__ import annotations

import ast
import tarfile
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from jagg.scale.hpsv3 import (
    DTYPE,
    INSTRUCTION,
    PIXELS,
    PROMPT_WITH_SPECIAL_TOKEN,
    REWARD_TOKEN,
    _rm_head,
    chat_text,
    resized_hw,
)

VERSION = "1.0.0"
SDIST = Path(__file__).resolve().parents[1] / "cache" / "hpsv3" / f"hpsv3-{VERSION}.tar.gz"
PROMPTS = ["a photo of a cat", 'an "astronaut" {riding} a horse, 4k!', ""]


@pytest.fixture(scope="module")
def files():
    """path inside the package -> source text, from the sdist (skip when it has not been downloaded)."""
    if not SDIST.is_file():
        pytest.skip(f"{SDIST} absent (`make hpsv3-ref` downloads hpsv3=={VERSION} without its dependencies)")
    out = {}
    with tarfile.open(SDIST) as tar:
        for member in tar.getmembers():
            name = member.name.split("/", 1)[-1]
            if member.isfile() and name.startswith("hpsv3/") and name.endswith((".py", ".yaml")):
                out[name] = tar.extractfile(member).read().decode("utf-8")
    return out


def _constants(source: str) -> dict[str, str]:
    """The module-level string assignments of a file, as Python reads them."""
    return {
        node.targets[0].id: node.value.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def _definition(source: str, *path: str) -> str:
    """Source of the function or class at ``path`` (``("Class", "method")`` for a method), dedented."""
    body = ast.parse(source).body
    for name in path:
        (node,) = [n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
        body = node.body
    segment = ast.get_source_segment(source, node)
    return (
        segment if len(path) == 1 else "\n".join(line.removeprefix("    ") for line in segment.splitlines())
    )


def test_instruction_and_reward_suffix_are_theirs(files):
    theirs = _constants(files["hpsv3/dataset/data_collator_qwen.py"])
    assert theirs["INSTRUCTION"] == INSTRUCTION
    assert theirs["prompt_with_special_token"] == PROMPT_WITH_SPECIAL_TOKEN
    assert REWARD_TOKEN in theirs["prompt_with_special_token"]
    # the inferencer takes them from that file
    assert "from .dataset.data_collator_qwen import prompt_with_special_token" in files["hpsv3/inference.py"]


def test_user_turn_is_prepare_batch(files):
    """Their ``prepare_batch`` run with a recording processor: one user turn per image, the image then the text
    ``INSTRUCTION.format(text_prompt=prompt) + prompt_with_special_token``, min = max = our pixel count, the chat
    template with the generation prompt, right after the image placeholder in our rendered text."""
    theirs = _constants(files["hpsv3/dataset/data_collator_qwen.py"])
    calls = {}

    class Processor:
        def apply_chat_template(self, messages, **kwargs):
            calls["template"] = (messages, kwargs)
            return ["rendered"] * len(messages)

        def __call__(self, **kwargs):
            calls["processor"] = kwargs
            return kwargs

    namespace = {
        "INSTRUCTION": theirs["INSTRUCTION"],
        "prompt_with_special_token": theirs["prompt_with_special_token"],
        "prompt_without_special_token": theirs["prompt_without_special_token"],
        "process_vision_info": lambda messages: ([m[0]["content"][0]["image"] for m in messages], None),
    }
    exec(_definition(files["hpsv3/inference.py"], "HPSv3RewardInferencer", "prepare_batch"), namespace)
    this = types.SimpleNamespace(use_special_tokens=True, processor=Processor(), _prepare_inputs=lambda b: b)
    namespace["prepare_batch"](this, [f"image{i}" for i in range(len(PROMPTS))], PROMPTS)
    messages, kwargs = calls["template"]
    assert kwargs == {"tokenize": False, "add_generation_prompt": True}
    assert calls["processor"]["padding"] is True and calls["processor"]["text"] == ["rendered"] * len(PROMPTS)
    for i, (prompt, turns) in enumerate(zip(PROMPTS, messages, strict=True)):
        ((turn,),) = [turns]
        assert turn["role"] == "user" and [c["type"] for c in turn["content"]] == ["image", "text"]
        image, text = turn["content"]
        assert image["image"] == f"image{i}" and image["min_pixels"] == image["max_pixels"] == PIXELS
        ours = chat_text(prompt)
        placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
        assert ours.count(placeholder) == 1
        assert (
            ours[ours.index(placeholder) + len(placeholder) :]
            == text["text"] + "<|im_end|>\n<|im_start|>assistant\n"
        )
    yaml = files["hpsv3/config/HPSv3_7B.yaml"]
    assert "use_special_tokens: true" in yaml and "with_instruction: true" in yaml


def test_resize_is_smart_resize(files):
    source = files["hpsv3/dataset/utils.py"]
    namespace = {"math": __import__("math"), "IMAGE_FACTOR": 28, "MIN_PIXELS": 4 * 28 * 28}
    namespace["MAX_PIXELS"], namespace["MAX_RATIO"] = 16384 * 28 * 28, 200
    for name in ["round_by_factor", "ceil_by_factor", "floor_by_factor", "smart_resize"]:
        exec(_definition(source, name), namespace)
    sizes = [
        (1024, 1024),
        (16, 16),
        (720, 1280),
        (48, 40),
        (512, 768),
        (17, 50),
        (1, 150),
        (3000, 200),
        (449, 447),
    ]
    for h, w in sizes:
        assert resized_hw(h, w) == namespace["smart_resize"](h, w, 28, PIXELS, PIXELS), (h, w)
    assert "max_pixels: 200704" in files["hpsv3/config/HPSv3_7B.yaml"] and PIXELS == 200704


def test_head_and_dtype_are_theirs(files):
    """``Qwen2VLRewardModelBT.__init__`` with HPSv3_7B.yaml's head (``ranknet``, no ``rm_head_kwargs``, 2 outputs)
    on a stand-in base: the same layers as ``_rm_head``, the same outputs on the same weights, float32; the model in
    bf16 (``torch_dtype: "bfloat16"``, ``bf16: True``) as our default."""

    class Base(nn.Module):  # Qwen2VLForConditionalGeneration's place: only the config is used by the head
        def __init__(self, config):
            super().__init__()
            self.config = config

    namespace = {"nn": nn, "torch": torch, "Qwen2VLForConditionalGeneration": Base}
    namespace.update(Optional=__import__("typing").Optional, List=list)
    exec(_definition(files["hpsv3/model/qwen2vl_trainer.py"], "Qwen2VLRewardModelBT"), namespace)
    yaml = files["hpsv3/config/HPSv3_7B.yaml"]
    assert 'rm_head_type: "ranknet"' in yaml and "output_dim: 2" in yaml and "rm_head_kwargs" not in yaml
    torch.manual_seed(0)
    theirs = namespace["Qwen2VLRewardModelBT"](
        types.SimpleNamespace(hidden_size=48),
        output_dim=2,
        reward_token="special",
        special_token_ids=[7],
        rm_head_type="ranknet",
        rm_head_kwargs=None,
    ).rm_head.eval()
    ours = _rm_head(48).eval()
    assert repr(theirs) == repr(ours)
    assert {p.dtype for p in theirs.parameters()} == {torch.float32}
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 48)
    torch.testing.assert_close(ours(x), theirs(x), atol=0, rtol=0)
    assert 'torch_dtype: "bfloat16"' in yaml and "bf16: True" in yaml and torch.bfloat16 == DTYPE
    train = files["hpsv3/train.py"]
    assert "model.to(torch.bfloat16)" in train and "model.rm_head.to(torch.float32)" in train
