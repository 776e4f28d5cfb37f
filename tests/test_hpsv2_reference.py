"""Our HPSv2.1 scorer against the ``hpsv2`` package itself (``hpsv2x==1.2.0``, installed without dependencies).

hpsv2 is not a dependency (its pins: pytest 7.2, protobuf<4); this test uses it from ``cache/hpsv2x`` (``make
hpsv2-ref`` installs it there; the test tries the same ``pip install --no-deps --target`` once and skips with
the reason when that fails, e.g. offline; ``JAGG_HPSV2_INSTALL=0`` disables the attempt). Only the bundled
``hpsv2.src.open_clip`` and ``hpsv2.img_score`` are used; ``clint`` (progress bars of its downloader, not
installed here) is stubbed. On the same random-init checkpoint of a tiny open_clip ViT (registered in both
open_clip registries), ``hpsv2.img_score.score`` (its model construction with the arguments of
``initialize_model``, its ``preprocess_val`` on PIL images, its tokenizer) and ``HPSv2Reward`` give the same
scores; the real ViT-H-14 architecture (config, tokenizer, state-dict layout) is compared on the meta device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from jagg.scale.rewards import HPSv2Reward

REQUIREMENT = "hpsv2x==1.2.0"
TARGET = Path(__file__).resolve().parents[1] / "cache" / "hpsv2x"
IMG = 32
TINY = dict(
    embed_dim=16,
    vision_cfg=dict(image_size=IMG, layers=2, width=32, head_width=16, patch_size=8),
    text_cfg=dict(context_length=77, vocab_size=49408, width=32, heads=2, layers=2),
)
PROMPTS = ["a red circle on the left", "a photo of a cat", "An astronaut riding a horse, 4k!", "x"]


def _import_hpsv2():
    """(hpsv2.img_score, hpsv2.src.open_clip) from an installed copy or ``cache/hpsv2x``; ImportError if absent."""
    if "clint" not in sys.modules:
        try:
            import clint  # noqa: F401
        except ImportError:  # only used by hpsv2's downloader
            clint = types.ModuleType("clint")
            clint.textui = types.ModuleType("clint.textui")
            clint.textui.progress = None
            sys.modules.update({"clint": clint, "clint.textui": clint.textui})
    if TARGET.is_dir() and str(TARGET) not in sys.path:
        sys.path.append(str(TARGET))
    import hpsv2.img_score as img_score
    from hpsv2.src import open_clip as hps_open_clip

    return img_score, hps_open_clip


@pytest.fixture(scope="module")
def hpsv2():
    try:
        return _import_hpsv2()
    except ImportError:
        pass
    if os.environ.get("JAGG_HPSV2_INSTALL", "1") == "0":
        pytest.skip(f"hpsv2 not installed and JAGG_HPSV2_INSTALL=0 (run `make hpsv2-ref` for {REQUIREMENT})")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    try:
        done = subprocess.run(
            [*cmd, "--target", str(TARGET), REQUIREMENT], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"{REQUIREMENT} not installable here: {e}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"{REQUIREMENT} not installable here (pip install --no-deps failed: {last})")
    return _import_hpsv2()


@pytest.fixture(scope="module")
def tiny_checkpoint(hpsv2, tmp_path_factory):
    """A random-init tiny ViT checkpoint ``{"state_dict": ...}`` (what hpsv2's ``score`` loads), its arch name."""
    import open_clip

    _, hps_open_clip = hpsv2
    d = tmp_path_factory.mktemp("hps")
    (d / "tiny-hps-ref.json").write_text(json.dumps(TINY))
    open_clip.add_model_config(d / "tiny-hps-ref.json")
    hps_open_clip.add_model_config(d / "tiny-hps-ref.json")
    torch.manual_seed(3)
    model = open_clip.create_model("tiny-hps-ref")
    with torch.no_grad():  # move every weight off its init (e.g. LayerNorm scales 1, biases 0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.save({"state_dict": model.state_dict()}, d / "hps.pt")
    return str(d / "hps.pt"), "tiny-hps-ref"


def _hpsv2_scores(hpsv2, checkpoint: str, arch: str, pil_images, prompts) -> np.ndarray:
    """hpsv2.img_score.score with the model hpsv2's ``initialize_model`` builds, except name / pretrained."""
    img_score, hps_open_clip = hpsv2
    model, _, preprocess_val = hps_open_clip.create_model_and_transforms(
        arch,
        None,  # initialize_model asks for the laion2B weights; score() replaces every weight anyway
        precision="amp",
        device="cpu",
        jit=False,
        force_quick_gelu=False,
        force_custom_text=False,
        force_patch_dropout=False,
        force_image_size=None,
        pretrained_image=False,
        image_mean=None,
        image_std=None,
        light_augmentation=True,
        aug_cfg={},
        output_dict=True,
        with_score_predictor=False,
        with_region_predictor=False,
    )
    saved = dict(img_score.model_dict)
    img_score.model_dict.update(model=model, preprocess_val=preprocess_val)
    try:
        return np.array(
            [
                img_score.score(im, p, cp=checkpoint, hps_version="v2.1")[0]
                for im, p in zip(pil_images, prompts)
            ]
        )
    finally:
        img_score.model_dict.clear()
        img_score.model_dict.update(saved)


@pytest.mark.parametrize("size", [(IMG, IMG), (80, 80), (48, 80), (90, 50)])
def test_scores_equal_hpsv2(hpsv2, tiny_checkpoint, size):
    """Same checkpoint, same pixels (uint8, as a PIL image for hpsv2): same HPS scores, square or not."""
    from PIL import Image

    pixels = np.random.default_rng(sum(size)).integers(0, 256, size=(len(PROMPTS), *size, 3), dtype=np.uint8)
    want = _hpsv2_scores(hpsv2, *tiny_checkpoint, [Image.fromarray(a) for a in pixels], PROMPTS)
    ours = HPSv2Reward(checkpoint=tiny_checkpoint[0], arch=tiny_checkpoint[1])
    got = ours(torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255, PROMPTS)
    assert np.abs(want).max() > 1e-3 and np.ptp(want) > 1e-3  # not a degenerate model
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=2e-5)


def test_vit_h_14_is_the_same_network(hpsv2):
    """The real architecture: same config, same tokenizer ids, same state-dict names and shapes (meta)."""
    import open_clip

    _, hps_open_clip = hpsv2
    assert hps_open_clip.get_model_config("ViT-H-14") == open_clip.get_model_config("ViT-H-14")
    torch.testing.assert_close(
        hps_open_clip.get_tokenizer("ViT-H-14")(PROMPTS), open_clip.get_tokenizer("ViT-H-14")(PROMPTS)
    )
    with torch.device("meta"):
        theirs = hps_open_clip.create_model(
            "ViT-H-14", None, precision="amp", device="meta", output_dict=True
        )
        ours = open_clip.create_model("ViT-H-14", pretrained=None, device="meta")
    shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert round(sum(int(np.prod(s)) for s in shapes.values()) / 1e6) == 986  # ViT-H-14 CLIP, 986M
