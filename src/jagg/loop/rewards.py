"""A run's rewards: every reward module registered, each reward built with its kwargs on the run's device.

This is where the registry (``jagg.rewards.REWARDS``) is filled: importing this module imports the three
modules that register rewards (the JPEG rewards, the embedded world's judges, the real HPSv2.1 / PickScore /
CLIPScore), so the lower layers never import the ones above them to find a reward.
"""

from __future__ import annotations

import inspect

import torch

import jagg.rewards.jpeg  # noqa: F401  (registers jpeg, jpeg_incompressibility)
import jagg.scale.rewards  # noqa: F401  (registers hpsv2, pickscore, clipscore)
import jagg.world.rewards  # noqa: F401  (registers clip, pref, attr, attr_soft)
from jagg.config import Config
from jagg.loop import preflight
from jagg.rewards import REWARDS, Reward, build_reward

REWARD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_reward_names(cfg: Config) -> None:
    """``ConfigError`` naming the key when ``reward.weights`` or ``reward.eval`` names a reward missing from the
    filled registry (also one registered after import), or a ``reward.kwargs.<name>.dtype`` is not a dtype name
    (``jagg.loop.preflight.check_reward_names`` against the registry)."""
    preflight.check_reward_names(cfg, known=REWARDS)


def build_run_reward(name: str, kwargs: dict, device: torch.device) -> Reward:
    """``build_reward(name, **kwargs)``; on a GPU, factories that accept a ``device`` get the run's device.

    ``dtype`` may be given by name in the config (``reward.kwargs: {hpsv2: {dtype: bf16}}``): fp32 | bf16 | fp16
    (the CLIP rewards run their model in that dtype; the dry-run memory plan counts it).
    """
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("dtype"), str):  # checked by check_reward_names
        kwargs["dtype"] = REWARD_DTYPES[kwargs["dtype"]]
    factory = REWARDS.get(name)
    if factory is not None and device.type == "cuda" and "device" not in kwargs:
        params = inspect.signature(factory).parameters.values()
        if any(p.name == "device" or p.kind is p.VAR_KEYWORD for p in params):
            kwargs["device"] = device
    return build_reward(name, **kwargs)
