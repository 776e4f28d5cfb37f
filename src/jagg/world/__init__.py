"""The embedded default: an offline text-to-image world with project-trained backbones and rewards.

    World / WorldConfig     colours x shapes x positions, prompts, deterministic PIL renders, pixel latents
    WorldTextEncoder        frozen prompt encoder: encode_prompts(list[str]) -> jagg.backbones.TextCond
    load_pretrained(name)   (backbone, text_encoder) for "flux" | "qwenimage" from cache/world/
    load_world_rewards()    {"clip", "pref", "attr"} rewards (also registered in jagg.rewards)
    ArtefactError           raised when the cache is missing ("run `make pretrain`") or stale

Everything is trained by ``make pretrain`` (``experiments/pretrain.py`` -> ``jagg.world.build``) in pixel
space on one CPU thread.
"""

from jagg.world.pretrained import (
    ArtefactError,
    check_artefact,
    default_cache_dir,
    load_pretrained,
    load_text_encoder,
    load_world_rewards,
)
from jagg.world.scene import Attributes, World, WorldConfig, prompt_of
from jagg.world.text import WordTokenizer, WorldTextEncoder

__all__ = [
    "ArtefactError",
    "Attributes",
    "WordTokenizer",
    "World",
    "WorldConfig",
    "WorldTextEncoder",
    "check_artefact",
    "default_cache_dir",
    "load_pretrained",
    "load_text_encoder",
    "load_world_rewards",
    "prompt_of",
]
