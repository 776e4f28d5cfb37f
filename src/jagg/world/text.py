"""Word-level tokenizer, a tiny CLIP-style text tower, and the frozen text encoder the world backbones use.

The real models condition on frozen pretrained text encoders (T5 + CLIP-L for Flux, Qwen2.5-VL for
Qwen-Image). Here the frozen encoder is the text tower of a tiny CLIP trained contrastively on the world
(``jagg.world.train.train_clip``) with its own seed and weights, never the ``clip`` reward's weights.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from jagg.models import TextCond

SPECIALS = ("<pad>", "<bos>", "<eos>")


class WordTokenizer:
    """Whitespace tokenizer over a fixed vocabulary: [<bos>, words..., <eos>, <pad>...] of length ``max_len``."""

    def __init__(self, words: list[str], max_len: int = 8) -> None:
        self.vocab = list(SPECIALS) + sorted(set(words))
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self.max_len = max_len

    def __len__(self) -> int:
        return len(self.vocab)

    def __call__(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """-> ids (B, L) long and mask (B, L) long (1 for <bos> .. <eos>)."""
        ids = torch.zeros(len(prompts), self.max_len, dtype=torch.long)
        for b, p in enumerate(prompts):
            words = p.strip().lower().split()
            unknown = [w for w in words if w not in self.index]
            if unknown:
                raise ValueError(f"words {unknown} of prompt {p!r} are not in the world vocabulary")
            toks = [1] + [self.index[w] for w in words] + [2]
            if len(toks) > self.max_len:
                raise ValueError(f"prompt {p!r} has {len(toks)} tokens > max_len {self.max_len}")
            ids[b, : len(toks)] = torch.tensor(toks)
        return ids, (ids != 0).long()


class TextTower(nn.Module):
    """Token + position embedding, pre-norm transformer layers, final LayerNorm (CLIP text tower, tiny).

    Returns per-token features (B, L, width) and the pooled feature at <eos> (B, width), as CLIP does.
    """

    def __init__(self, vocab_size: int, width: int = 32, layers: int = 2, heads: int = 2, max_len: int = 8):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Parameter(torch.randn(max_len, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width, heads, 2 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        h = self.tok(ids) + self.pos[: ids.shape[1]]  # (B, L, D)
        h = self.norm(self.blocks(h, src_key_padding_mask=mask == 0))
        eos = mask.sum(dim=1) - 1  # index of <eos>
        return h, h[torch.arange(ids.shape[0]), eos]


class WorldTextEncoder(nn.Module):
    """Frozen prompt encoder: ``encode_prompts(prompts) -> TextCond(embeds (B,L,D), mask (B,L), pooled (B,D))``."""

    def __init__(self, tokenizer: WordTokenizer, tower: TextTower) -> None:
        super().__init__()
        self.tokenizer, self.tower = tokenizer, tower
        self.requires_grad_(False).eval()

    @property
    def width(self) -> int:
        return self.tower.norm.normalized_shape[0]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> TextCond:
        ids, mask = self.tokenizer(prompts)
        embeds, pooled = self.tower(ids, mask)
        return TextCond(embeds=embeds, mask=mask, pooled=pooled)
