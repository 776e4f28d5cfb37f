"""The world's small judge models: a CLIP-style dual encoder, a preference model and an attribute classifier.

All take images (B, 3, H, W) in [0, 1]. They are the project-trained stand-ins for the paper's rewards:
    TinyCLIP        CLIPScore analogue: cosine of image and prompt embeddings (Radford et al. 2021, CLIP).
    PreferenceModel HPSv2.1 / PickScore analogue: a scalar score trained with a Bradley-Terry loss on
                    (preferred, rejected) pairs for one prompt (Kirstain et al. 2023; Wu et al. 2023).
    AttrClassifier  GenEval analogue: colour / shape / position heads; exact match against the prompt
                    (Ghosh et al. 2023, GenEval).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jagg.world.text import TextTower


class ConvTower(nn.Module):
    """Three 3x3 convs (two stride-2), 4x4 adaptive pool, linear head. Keeps *where* things are (no global pool)."""

    def __init__(self, out_dim: int, channels: tuple[int, int, int] = (32, 48, 64), frames: int = 1) -> None:
        super().__init__()
        c0, c1, c2 = channels
        self.net = nn.Sequential(
            nn.Conv2d(3 * frames, c0, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(c0, c1, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv2d(c1, c2, 3, stride=2, padding=1),
            nn.GELU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(c2 * 16, out_dim),
        )

    def forward(self, images: Tensor) -> Tensor:
        if images.ndim == 5:  # a clip (B, 3, F, H, W): its frames stacked as channels (early fusion)
            images = images.flatten(1, 2)
        return self.net(images * 2 - 1)  # (B, out_dim)


class TinyCLIP(nn.Module):
    """Dual encoder with a learned temperature; ``forward`` returns unit image and text embeddings. With
    ``frames`` > 1 the visual side reads a clip (B, 3, F, H, W), its frames stacked as channels."""

    def __init__(
        self, vocab_size: int, width: int = 32, embed_dim: int = 64, max_len: int = 8, frames: int = 1
    ) -> None:
        super().__init__()
        self.visual = ConvTower(embed_dim, frames=frames)
        self.text = TextTower(vocab_size, width, max_len=max_len)
        self.text_proj = nn.Linear(width, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def encode_image(self, images: Tensor) -> Tensor:
        return F.normalize(self.visual(images), dim=-1)  # (B, E)

    def encode_text(self, ids: Tensor, mask: Tensor) -> Tensor:
        return F.normalize(self.text_proj(self.text(ids, mask)[1]), dim=-1)  # (B, E)


class PreferenceModel(nn.Module):
    """score(image, prompt) = scale * cos(image, prompt) + quality(image): a CLIP-style aligner plus a
    prompt-free quality term, as HPSv2 / PickScore are CLIP models fine-tuned on human preference pairs. With
    ``frames`` > 1 it scores a clip (B, 3, F, H, W) (the video world's ``video_pref``)."""

    def __init__(
        self,
        vocab_size: int,
        width: int = 32,
        hidden: int = 96,
        embed_dim: int = 64,
        max_len: int = 8,
        frames: int = 1,
    ):
        super().__init__()
        self.visual = ConvTower(hidden, frames=frames)
        self.image_proj = nn.Linear(hidden, embed_dim, bias=False)
        self.quality = nn.Linear(hidden, 1)
        self.text = TextTower(vocab_size, width, layers=1, max_len=max_len)
        self.text_proj = nn.Linear(width, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def encode_text(self, ids: Tensor, mask: Tensor) -> Tensor:
        return F.normalize(self.text_proj(self.text(ids, mask)[1]), dim=-1)  # (B, E)

    def features(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """Unit image embedding (B, E) and quality score (B,)."""
        h = F.gelu(self.visual(images))
        return F.normalize(self.image_proj(h), dim=-1), self.quality(h).squeeze(-1)

    def forward(self, images: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
        img, quality = self.features(images)
        return self.logit_scale.exp() * (img * self.encode_text(ids, mask)).sum(-1) + quality  # (B,)


class AttributeHeads(nn.Module):
    """Base of the attribute models: ``forward(images)`` returns colour, shape and position logits."""

    @torch.no_grad()
    def predict(self, images: Tensor) -> Tensor:
        """(B, 3) long: argmax colour, shape, position."""
        return torch.stack([lg.argmax(-1) for lg in self(images)], dim=-1)


class AttrClassifier(AttributeHeads):
    """Image -> logits for colour, shape and position (three heads on a shared conv trunk)."""

    def __init__(self, num_classes: tuple[int, int, int], hidden: int = 128) -> None:
        super().__init__()
        self.trunk = nn.Sequential(ConvTower(hidden), nn.GELU())
        self.heads = nn.ModuleList(nn.Linear(hidden, n) for n in num_classes)

    def forward(self, images: Tensor) -> list[Tensor]:
        h = self.trunk(images)
        return [head(h) for head in self.heads]  # [(B, n_colour), (B, n_shape), (B, n_position)]


class AttrJudge(AttributeHeads):
    """Eval-only attribute judge: colour / shape / position heads, built to be independent of ``AttrClassifier``.

    A different architecture (CoordConv input: two coordinate channels, so position is read from explicit
    coordinates rather than from where a stride-2 tower's pooled cells fall; 5x5 then 3x3 convolutions with ReLU
    and max pooling; a dropout MLP head), a different seed and different training data (renders degraded the
    way generated images are: see ``jagg.world.train.train_attr_judge``). The policy never trains against it;
    it is the held-out check on the ``attr`` reward (reward name ``attr_judge``, eval only).
    """

    def __init__(self, num_classes: tuple[int, int, int], size: int = 16, hidden: int = 128) -> None:
        super().__init__()
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
        self.register_buffer("coords", torch.stack([xs, ys])[None], persistent=False)  # (1, 2, H, W)
        self.features = nn.Sequential(
            nn.Conv2d(5, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
        )
        self.mlp = nn.Sequential(nn.Linear(64 * (size // 4) ** 2, hidden), nn.ReLU(), nn.Dropout(0.1))
        self.heads = nn.ModuleList(nn.Linear(hidden, n) for n in num_classes)

    def forward(self, images: Tensor) -> list[Tensor]:
        x = torch.cat([images * 2 - 1, self.coords.expand(images.shape[0], -1, -1, -1)], dim=1)
        h = self.mlp(self.features(x))
        return [head(h) for head in self.heads]
