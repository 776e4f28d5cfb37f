"""Training and evaluation of everything in the embedded world: judges (CLIP, preference, attributes) and
the rectified-flow backbones.

Every trainer is a deterministic function of its config (seeded data pools and torch generators, one thread)
and returns a small dict of statistics that goes into the artefact manifest.

Rectified-flow matching (Liu et al. 2022; Esser et al. 2024, SD3): x_sigma = (1 - sigma) x0 + sigma eps,
target v = eps - x0 (docs/conventions.md), sigma ~ logit-normal(0, 1) as in SD3.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from jagg.engine.sampling import sample_trajectory
from jagg.engine.sde import shifted_linear_sigmas
from jagg.models import Backbone
from jagg.world.models import AttrClassifier, AttrJudge, PreferenceModel, TinyCLIP
from jagg.world.scene import Attributes, World
from jagg.world.text import WordTokenizer, WorldTextEncoder
from jagg.world.video import VideoWorld


def frames_of(world: World | VideoWorld) -> int:
    """Frames of a world's samples: 1 for the image world (its judges read images)."""
    return world.frames if isinstance(world, VideoWorld) else 1


# --------------------------------------------------------------------------- data
def render_pool(
    world: World | VideoWorld, prompts: list[str], per_prompt: int, seed: int
) -> tuple[Tensor, Tensor]:
    """``per_prompt`` renders of every prompt -> images (N, 3, H, W) (clips (N, 3, F, H, W)) and world prompt
    indices (N,)."""
    reps = [p for p in prompts for _ in range(per_prompt)]
    idx = torch.tensor([world.prompt_index[p] for p in reps])
    return world.render(reps, seed), idx


def box_blur(images: Tensor) -> Tensor:
    """3x3 mean filter with replicate padding, (B, 3, H, W)."""
    return F.avg_pool2d(F.pad(images, (1, 1, 1, 1), mode="replicate"), 3, stride=1)


def augment(images: Tensor, gen: torch.Generator, max_noise: float = 0.06, p_blur: float = 0.3) -> Tensor:
    """Mild robustness augmentation for the judges: Gaussian noise sigma ~ U(0, max_noise), random 3x3 blur.
    A clip (B, 3, F, H, W) is augmented as one image of 3F channels (the same noise level and blur per clip)."""
    if images.ndim == 5:
        return augment(images.flatten(1, 2), gen, max_noise, p_blur).view(images.shape)
    b = images.shape[0]
    sigma = torch.rand(b, 1, 1, 1, generator=gen) * max_noise
    blur = torch.rand(b, 1, 1, 1, generator=gen) < p_blur
    x = torch.where(blur, box_blur(images), images)
    return (x + sigma * torch.randn(images.shape, generator=gen)).clamp(0, 1)


DEGRADATIONS = ("position", "color", "shape", "noise", "noisy_background", "blur", "faded", "empty", "extra")


def preference_pairs(world: World, n: int, seed: int) -> tuple[Tensor, Tensor, Tensor, list[str]]:
    """``n`` (preferred, rejected) pairs: a faithful clean render vs a degraded one for the same prompt.

    Degradations cycle through ``DEGRADATIONS``: a misplaced / wrong-colour / wrong-shape object, pixel noise,
    a noisy background (the hack a pure alignment reward invites), blur, low contrast, an empty scene, and a
    distracting extra object. Returns good, bad (n, 3, H, W), prompt indices (n,) and the degradation names.
    """
    c = world.config
    wrong = {
        "position": lambda a, other: a._replace(position=other(c.positions, a.position)),
        "color": lambda a, other: a._replace(color=other(c.colors, a.color)),
        "shape": lambda a, other: a._replace(shape=other(c.shapes, a.shape)),
        # a second, different object elsewhere
        "extra": lambda a, other: Attributes(
            other(c.colors, a.color), other(c.shapes, a.shape), other(c.positions, a.position)
        ),
    }

    def composite(rerendered, rng, kinds, attrs):
        extra, alpha2, bg2 = rerendered

        def own(i: int, kind: str, x: Tensor, u: float, gen: torch.Generator) -> Tensor | None:
            if kind == "extra":  # composite the second object over the faithful render
                return x * (1 - alpha2[i]) + (extra[i] - bg2[i] * (1 - alpha2[i]))
            return None

        return own

    return degraded_pairs(world, n, seed, DEGRADATIONS, wrong, composite, blur=lambda t: box_blur(t[None])[0])


def degraded_pairs(
    world, n: int, seed: int, degradations: tuple[str, ...], wrong: dict, special: Callable, blur: Callable
) -> tuple[Tensor, Tensor, Tensor, list[str]]:
    """The pair maker of both worlds (``preference_pairs``, ``jagg.world.video_train.video_preference_pairs``),
    in the one draw order that fixes the pretrained artefacts bitwise: from one numpy generator ``n`` prompts,
    their degradations (cycling through ``degradations``), the faithful renders, then each pair's wrong
    attributes (``wrong[kind](attrs, other)``; ``other(values, current)`` draws another value) re-rendered;
    ``special(rerendered, rng, kinds, attrs)`` may draw more before the pairs are degraded in order, each with
    its strength u: by ``special``'s ``own(i, kind, x, u, gen)`` where that gives a tensor, else by the re-render
    (an ``empty`` kind re-renders nothing), else by ``pixel_degradation`` with ``blur``."""
    rng = np.random.default_rng(seed)
    prompts = [world.prompts[i] for i in rng.integers(0, len(world.prompts), n)]
    kinds = [degradations[i % len(degradations)] for i in range(n)]
    attrs = [world.parse(p) for p in prompts]
    good, alpha, bg = world.render_attributes(attrs, rng)

    def other(values: tuple[str, ...], current: str) -> str:
        return str(rng.choice([v for v in values if v != current]))

    bad_attrs = [wrong[k](a, other) if k in wrong else None for a, k in zip(attrs, kinds, strict=True)]
    rerendered = world.render_attributes(bad_attrs, rng)
    own = special(rerendered, rng, kinds, attrs)
    gen = torch.Generator().manual_seed(seed)
    bad = good.clone()
    for i, k in enumerate(kinds):
        x = good[i]
        u = float(rng.uniform())
        if (y := own(i, k, x, u, gen)) is not None:
            bad[i] = y
        elif k in wrong or k == "empty":
            bad[i] = rerendered[0][i]
        else:
            bad[i] = pixel_degradation(k, x, alpha[i], bg[i], u, gen, blur)
    idx = torch.tensor([world.prompt_index[p] for p in prompts])
    return good, bad.clamp(0, 1), idx, kinds


def pixel_degradation(
    kind: str, x: Tensor, alpha: Tensor, background: Tensor, u: float, gen: torch.Generator, blur
) -> Tensor:
    """The degradations that need no re-render, shared by the image pairs and the video world's clip pairs:
    pixel noise, a noisy background (outside the object's ``alpha``), blur (``blur`` once or twice: an image's
    or a clip's), low contrast toward the ``background``. ``u`` in [0, 1) sets the strength; only ``gen`` draws
    (the pairs' numpy generator draws nothing here: its order fixes the pretrained artefacts bitwise)."""
    if kind == "noise":
        return x + (0.08 + 0.3 * u) * torch.randn(x.shape, generator=gen)
    if kind == "noisy_background":
        return x + (0.15 + 0.5 * u) * (2 * torch.rand(x.shape, generator=gen) - 1) * (1 - alpha)
    if kind == "blur":
        return blur(blur(x)) if u < 0.5 else blur(x)
    if kind == "faded":
        return background + (x - background) * (0.25 + 0.3 * u)
    raise ValueError(f"unknown degradation {kind!r}")


# --------------------------------------------------------------------------- optimisation
def fit(
    params,
    loss_fn: Callable[[int], Tensor],
    steps: int,
    lr: float,
    warmup: int = 50,
    weight_decay: float = 0.0,
    log: Callable[[str], None] | None = None,
    log_every: int = 200,
) -> dict:
    """AdamW with linear warmup and cosine decay to 0, grad-norm clip 1. Returns final loss and seconds."""
    params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)),
    )
    t0, recent = time.perf_counter(), []
    for step in range(steps):
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        recent = (recent + [loss.item()])[-50:]
        if log and (step + 1) % log_every == 0:
            log(f"  step {step + 1}/{steps}  loss {np.mean(recent):.4f}  {time.perf_counter() - t0:.0f} s")
    return {
        "final_loss": float(np.mean(recent)) if recent else float("nan"),
        "train_seconds": time.perf_counter() - t0,
    }


@dataclass(frozen=True)
class JudgeTrainConfig:
    """Steps and data of one judge (CLIP, preference or attribute model)."""

    steps: int = 600
    batch: int = 128
    lr: float = 2e-3
    per_prompt: int = 60  # renders per prompt in the training pool (CLIP, attributes)
    pairs: int = 18000  # preference pairs in the training pool
    seed: int = 0


def train_clip(
    world: World | VideoWorld, tokenizer: WordTokenizer, cfg: JudgeTrainConfig
) -> tuple[TinyCLIP, dict]:
    """Image -> prompt InfoNCE over all world prompts (CLIP's image-side loss with the full prompt set as
    negatives; the in-batch text side is redundant when every prompt is in every softmax). On the video world
    the visual side reads clips (``TinyCLIP(frames=F)``)."""
    torch.manual_seed(cfg.seed)
    model = TinyCLIP(len(tokenizer), max_len=tokenizer.max_len, frames=frames_of(world))
    images, labels = render_pool(world, world.prompts, cfg.per_prompt, seed=10_000 + cfg.seed)
    ids, mask = tokenizer(world.prompts)
    gen = torch.Generator().manual_seed(cfg.seed)

    def loss_fn(_step: int) -> Tensor:
        j = torch.randint(0, len(images), (cfg.batch,), generator=gen)
        img = model.encode_image(augment(images[j], gen))  # (B, E)
        txt = model.encode_text(ids, mask)  # (P, E)
        return F.cross_entropy(model.logit_scale.exp() * img @ txt.T, labels[j])

    stats = fit(model.parameters(), loss_fn, cfg.steps, cfg.lr)
    return model.eval(), stats


def train_preference(
    world: World | VideoWorld,
    tokenizer: WordTokenizer,
    cfg: JudgeTrainConfig,
    pairs: Callable[..., tuple[Tensor, Tensor, Tensor, list[str]]] = preference_pairs,
) -> tuple[PreferenceModel, dict]:
    """Bradley-Terry loss -log sigmoid(s(good) - s(bad)) on ``pairs`` (``preference_pairs``; the video world's
    ``video_preference_pairs``), plus the CLIP image->prompt InfoNCE on the preferred images (HPSv2 / PickScore
    start from a contrastively trained CLIP; here both objectives are trained jointly from scratch)."""
    torch.manual_seed(cfg.seed)
    model = PreferenceModel(len(tokenizer), max_len=tokenizer.max_len, frames=frames_of(world))
    good, bad, pidx, _ = pairs(world, cfg.pairs, seed=20_000 + cfg.seed)
    ids, mask = tokenizer(world.prompts)
    gen = torch.Generator().manual_seed(cfg.seed)

    def loss_fn(_step: int) -> Tensor:
        j = torch.randint(0, len(good), (cfg.batch,), generator=gen)
        img, quality = model.features(torch.cat([good[j], bad[j]]))  # (2B, E), (2B,)
        txt = model.encode_text(ids, mask)  # (P, E)
        logits = model.logit_scale.exp() * img @ txt.T  # (2B, P)
        score = logits.gather(1, pidx[j].repeat(2)[:, None]).squeeze(1) + quality
        bt = -F.logsigmoid(score[: cfg.batch] - score[cfg.batch :]).mean()
        return bt + F.cross_entropy(logits[: cfg.batch], pidx[j])

    stats = fit(model.parameters(), loss_fn, cfg.steps, cfg.lr)
    return model.eval(), stats


def train_attributes(world: World, cfg: JudgeTrainConfig) -> tuple[AttrClassifier, dict]:
    """Sum of three cross-entropies (colour, shape, position) on augmented renders with known labels."""
    torch.manual_seed(cfg.seed)
    model = AttrClassifier(world.num_classes)
    images, pidx = render_pool(world, world.prompts, cfg.per_prompt, seed=30_000 + cfg.seed)
    labels = world.labels(world.prompts)[pidx]  # (N, 3)
    gen = torch.Generator().manual_seed(cfg.seed)
    stats = fit_attribute_heads(model, images, labels, augment, gen, cfg)
    return model.eval(), stats


def fit_attribute_heads(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    aug: Callable[[Tensor, torch.Generator], Tensor],
    gen: torch.Generator,
    cfg: JudgeTrainConfig | EvalJudgeTrainConfig,
) -> dict:
    """Sum of the colour, shape and position cross-entropies on augmented random batches of ``images``."""

    def loss_fn(_step: int) -> Tensor:
        j = torch.randint(0, len(images), (cfg.batch,), generator=gen)
        logits = model(aug(images[j], gen))
        return sum(F.cross_entropy(lg, labels[j, k]) for k, lg in enumerate(logits))

    return fit(model.parameters(), loss_fn, cfg.steps, cfg.lr)


# --------------------------------------------------------------------------- eval-only attribute judge
@dataclass(frozen=True)
class EvalJudgeTrainConfig:
    """Data and steps of the eval-only attribute judge (``AttrJudge``)."""

    steps: int = 2000
    batch: int = 128
    lr: float = 2e-3
    per_prompt: int = 40  # clean renders per prompt, and as many generator-degraded ones
    sdedit_sigma: tuple[float, float] = (0.15, 0.5)  # SDEdit start noise, uniform in this range
    sdedit_steps: int = 6
    seed: int = 11


@torch.no_grad()
def generator_degrade(
    backbones: list[Backbone],
    text_encoder: WorldTextEncoder,
    world: World,
    images: Tensor,
    prompts: list[str],
    gen: torch.Generator,
    sigma_range: tuple[float, float] = (0.15, 0.5),
    steps: int = 6,
    chunk: int = 512,
) -> Tensor:
    """Renders passed through a generator, SDEdit-style (Meng et al. 2022): noise each image to
    sigma0 ~ U(sigma_range), then integrate the rectified-flow ODE back to 0 with a pretrained backbone
    conditioned on the image's own prompt (Euler, ``steps`` steps; backbones alternate over the images).
    The result carries the generator's textures, soft edges and colour shifts while its content stays the
    render's (the start noise is low enough that the layout survives), so its labels are known."""
    lo, hi = sigma_range
    x0 = world.encode(images)
    s0 = lo + (hi - lo) * torch.rand(len(images), generator=gen)
    eps = torch.randn(x0.shape, generator=gen)
    x = (1 - s0.view(-1, 1, 1, 1)) * x0 + s0.view(-1, 1, 1, 1) * eps
    for k, backbone in enumerate(backbones):
        rows = torch.arange(k, len(images), len(backbones))
        for start in range(0, len(rows), chunk):
            r = rows[start : start + chunk]
            cond = text_encoder.encode_prompts([prompts[i] for i in r.tolist()])
            z, s = x[r], s0[r]
            for j in range(steps):
                sigma, nxt = s * (1 - j / steps), s * (1 - (j + 1) / steps)
                z = z + (nxt - sigma).view(-1, 1, 1, 1) * backbone.velocity(z, sigma, cond)
            x[r] = z
    return world.decode(x)


def judge_augment(images: Tensor, gen: torch.Generator) -> Tensor:
    """The judge's own augmentation (not ``augment``'s): contrast / brightness / per-channel gain jitter, a
    random one-pixel shift, and Gaussian noise (sigma ~ U(0, 0.08)) on half the images."""
    b = images.shape[0]
    u = lambda lo, hi, *shape: lo + (hi - lo) * torch.rand(b, *shape, generator=gen)  # noqa: E731
    mean = images.mean(dim=(1, 2, 3), keepdim=True)
    x = mean + u(0.7, 1.2, 1, 1, 1) * (images - mean) + u(-0.05, 0.05, 1, 1, 1)
    x = x * u(0.9, 1.1, 3, 1, 1)
    dy, dx = (int(v) for v in torch.randint(-1, 2, (2,), generator=gen))
    x = torch.roll(F.pad(x, (1, 1, 1, 1), mode="replicate"), (dy, dx), dims=(2, 3))[..., 1:-1, 1:-1]
    noisy = torch.rand(b, 1, 1, 1, generator=gen) < 0.5
    return (x + noisy * u(0.0, 0.08, 1, 1, 1) * torch.randn(x.shape, generator=gen)).clamp(0, 1)


def train_attr_judge(
    world: World,
    backbones: list[Backbone],
    text_encoder: WorldTextEncoder,
    cfg: EvalJudgeTrainConfig,
) -> tuple[AttrJudge, dict]:
    """Three cross-entropies on a pool that is half clean renders and half renders passed through the
    pretrained generators (``generator_degrade``), both with ``judge_augment``."""
    torch.manual_seed(cfg.seed)
    model = AttrJudge(world.num_classes, world.size)
    gen = torch.Generator().manual_seed(cfg.seed)
    clean, pidx = render_pool(world, world.prompts, cfg.per_prompt, seed=50_000 + cfg.seed)
    raw, gidx = render_pool(world, world.prompts, cfg.per_prompt, seed=60_000 + cfg.seed)
    prompts = [world.prompts[i] for i in gidx.tolist()]
    degraded = generator_degrade(
        backbones, text_encoder, world, raw, prompts, gen, cfg.sdedit_sigma, cfg.sdedit_steps
    )
    images = torch.cat([clean, degraded])
    labels = world.labels(world.prompts)[torch.cat([pidx, gidx])]  # (N, 3)
    model.train()
    stats = fit_attribute_heads(model, images, labels, judge_augment, gen, cfg)
    return model.eval(), stats


# --------------------------------------------------------------------------- flow backbones
@dataclass(frozen=True)
class FlowTrainConfig:
    """Rectified-flow pretraining of a backbone on the training prompts."""

    steps: int = 800
    batch: int = 64
    lr: float = 1e-3
    warmup: int = 50
    per_prompt: int = 200
    seed: int = 0


def flow_matching_loss(backbone: Backbone, x0: Tensor, cond, gen: torch.Generator) -> Tensor:
    """E ||v(x_sigma, sigma) - (eps - x0)||^2 with sigma ~ logit-normal(0, 1)."""
    b = x0.shape[0]
    eps = torch.randn(x0.shape, generator=gen)
    sigma = torch.sigmoid(torch.randn(b, generator=gen))  # (B,)
    s = sigma.view(b, *[1] * (x0.ndim - 1))  # (B, 1, 1, 1), a clip's (B, 1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * eps
    return F.mse_loss(backbone.velocity(x_t, sigma, cond), eps - x0)


def train_flow(
    backbone: Backbone,
    text_encoder: WorldTextEncoder,
    world: World | VideoWorld,
    cfg: FlowTrainConfig,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Train ``backbone`` in place on renders of ``world.train_prompts``; returns final loss and seconds."""
    torch.manual_seed(cfg.seed)
    images, pidx = render_pool(world, world.train_prompts, cfg.per_prompt, seed=40_000 + cfg.seed)
    latents = world.encode(images)
    cond_all = text_encoder.encode_prompts(world.prompts)  # frozen: encode each prompt once
    gen = torch.Generator().manual_seed(cfg.seed)
    backbone.train()

    def loss_fn(_step: int) -> Tensor:
        j = torch.randint(0, len(latents), (cfg.batch,), generator=gen)
        return flow_matching_loss(backbone, latents[j], cond_all.select(pidx[j]), gen)

    stats = fit(backbone.parameters(), loss_fn, cfg.steps, cfg.lr, warmup=cfg.warmup, log=log)
    backbone.eval()
    return stats


@torch.no_grad()
def sample_images(
    backbone: Backbone,
    text_encoder: WorldTextEncoder,
    world: World | VideoWorld,
    prompts: list[str],
    seed: int,
    steps: int = 16,
    shift: float = 3.0,
    chunk: int = 256,
) -> Tensor:
    """ODE samples (B, 3, H, W) in [0, 1] (the video world's clips (B, 3, F, H, W)) via ``sample_trajectory`` on
    ``shifted_linear_sigmas(steps, shift)``."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(len(prompts), *world.latent_shape, generator=gen)
    sigmas = shifted_linear_sigmas(steps, shift)
    out = []
    for i in range(0, len(prompts), chunk):
        cond = text_encoder.encode_prompts(prompts[i : i + chunk])
        traj = sample_trajectory(backbone.bind(cond), noise[i : i + chunk], sigmas, ["ode"] * steps)
        out.append(world.decode(traj.final))
    return torch.cat(out)


# --------------------------------------------------------------------------- evaluation
@torch.no_grad()
def clip_retrieval_accuracy(model: TinyCLIP, tokenizer: WordTokenizer, world: World, images, labels) -> float:
    """Top-1 accuracy of picking the right prompt among all world prompts."""
    txt = model.encode_text(*tokenizer(world.prompts))
    return (model.encode_image(images) @ txt.T).argmax(-1).eq(labels).float().mean().item()


@torch.no_grad()
def attribute_accuracy(model: AttrClassifier, world: World, images: Tensor, prompts: list[str]) -> dict:
    """Exact match (all three attributes right) and per-attribute accuracy."""
    hit = model.predict(images).eq(world.labels(prompts))  # (B, 3)
    names = ("color", "shape", "position")
    return {"exact": hit.all(-1).float().mean().item()} | {
        n: hit[:, k].float().mean().item() for k, n in enumerate(names)
    }


def agreement(a: Tensor, b: Tensor) -> dict:
    """Agreement of two 0/1 verdicts on the same samples: fraction equal and Cohen's kappa (chance-corrected:
    1 = perfect, 0 = what two independent judges with these base rates would reach)."""
    a, b = a.float().flatten(), b.float().flatten()
    po = a.eq(b).float().mean().item()
    pa, pb = a.mean().item(), b.mean().item()
    pe = pa * pb + (1 - pa) * (1 - pb)
    return {"n": a.numel(), "agree": po, "kappa": (po - pe) / (1 - pe) if pe < 1 else float("nan")}
