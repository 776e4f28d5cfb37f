"""The embedded default: an offline text-to-image world with project-trained backbones and rewards.

    World / WorldConfig     colours x shapes x positions, prompts, deterministic PIL renders, pixel latents
    WorldTextEncoder        frozen prompt encoder: encode_prompts(list[str]) -> jagg.models.TextCond
    load_pretrained(name)   (backbone, text_encoder) for "flux" | "qwenimage" | "wan" from cache/world/
    jagg.world.rewards      the "clip", "pref", "attr", "attr_soft" rewards and the eval-only "attr_judge",
                            "attr_geom" and "render_match" (registered in jagg.rewards)
    jagg.world.geometry     the non-learned attribute reading behind "attr_geom" (palette, centroid, harmonics)
    VideoWorld              the moving-shapes video world (jagg.world.video): clips (B, 3, F, H, W) of the same
                            objects moving right / left / up / down; its tiny Wan is load_pretrained("wan")
    jagg.world.video_rewards  "video_pref", "frames_*" and the eval-only "motion_geom" / "video_geom"
                            (jagg.world.motion: the motion read from the clip's geometry)
    ArtefactError           raised when the cache is missing ("run `make pretrain`") or stale (jagg.errors)

Everything is trained by ``make pretrain`` (``experiments/pretrain.py`` -> ``jagg.world.build``) in pixel
space on one CPU thread.

Layer: beside ``jagg.scale`` (neither imports the other); below the loop. It may import ``jagg.config`` and
the layers under it (``jagg.engine``, ``jagg.models``, ``jagg.rewards``, ``jagg.errors``, ``jagg.common``).
"""

from jagg.errors import ArtefactError
from jagg.world.pretrained import (
    check_artefact,
    default_cache_dir,
    load_pretrained,
    load_text_encoder,
)
from jagg.world.scene import Attributes, World, WorldConfig, prompt_of
from jagg.world.text import WordTokenizer, WorldTextEncoder
from jagg.world.video import VideoWorld, VideoWorldConfig

__all__ = [
    "ArtefactError",
    "Attributes",
    "WordTokenizer",
    "VideoWorld",
    "VideoWorldConfig",
    "World",
    "WorldConfig",
    "WorldTextEncoder",
    "check_artefact",
    "default_cache_dir",
    "load_pretrained",
    "load_text_encoder",
    "prompt_of",
]
