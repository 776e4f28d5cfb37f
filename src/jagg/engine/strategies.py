"""Backward strategies for one group of W consecutive trained steps: exact, JAGG and two ablations.

The exact group gradient is  sum_j J_j^T s_j  with J_j = dv_j/dtheta and s_j = dL_j/dv_j. JAGG (the paper,
arXiv 2607.17572; docs/method.md) approximates
    J_j ~ (1 - alpha_j) J_0 + alpha_j J_{W-1},   alpha_j = (t_0 - t_j) / (t_0 - t_{W-1}),
which turns the sum into  J_0^T s_base + J_{W-1}^T s_corr  with
    s_base = sum_j (1 - alpha_j) s_j,   s_corr = sum_j alpha_j s_j,
i.e. ONE joint ``torch.autograd.backward`` through the two endpoint forwards.

JAGG and the ablations differ only in the (W, 2) matrix that maps per-step signals onto the two endpoints:
    jagg       [1 - alpha_j, alpha_j]                       (paper, Theorem 1: exact for linear v, and W = 2)
    endpoints  [1, 0] for j = 0, [0, 1] for j = W-1, else 0 (the paper's reading (a): intermediate signals dropped)
    uniform    [1/2, 1/2]                                   (aggregation without t-weights)
    jagg_index [1 - j/(W-1), j/(W-1)]                       (the authors' code: step-index weights)
Steps whose row is all zeros need no forward at all, so the endpoints ablation also skips those forwards.

Every backward is one plan (``Interpolation``) of a micro-batch's T steps: K knot steps and a (T, K[, B]) matrix.
Exact is the identity, a group strategy one (W, 2) block, shared knots (``jagg.engine.knots``) the hat functions of t;
``interpolated_backward`` runs any of them. How it runs them (the same gradient at different costs) is a ``GraphRun``:
the graph mode (``GRAPH_MODES``), where the knots' own signals come from (``ENDPOINT_SIGNALS``) and a row bound; its
defaults are written there once, and ``jagg.engine.routing.BackwardSetting`` is a ``GraphRun`` bound to a routing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

# velocity(z, t) -> v : z (B, ...), t scalar tensor or (B,) ; v (B, ...). A velocity made of several networks
# that switch at fixed times says so with an ``expert_boundaries`` attribute (``expert_boundaries`` below).
Velocity = Callable[[Tensor, Tensor], Tensor]
# step_fn(j, v_j) -> scalar loss of step j of the group: all ``interpolated_backward`` needs of a loss
StepFn = Callable[[int, Tensor], Tensor]
# backward_fn(tensors, grads): adds sum_k J_k^T grads[k] to ``.grad``, as ``torch.autograd.backward`` does. An engine
# hands its own (``jagg.integrations.accelerate_backward``: accelerate's loss scaling, DeepSpeed's hooks).
BackwardFn = Callable[[Sequence[Tensor], Sequence[Tensor]], None]


def autograd_backward(tensors: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    """The default ``BackwardFn``: ``torch.autograd.backward`` (looked up at each call, so a wrapper sees it)."""
    torch.autograd.backward(tensors, grads)


@runtime_checkable
class StepLoss(Protocol):
    """The per-step loss of a micro-batch's T trained steps, as ``BackwardSetting.backward`` reads it: ``x``
    (T, B, ...) the steps' model inputs, ``sigma`` (T,) or (T, B) their strictly decreasing times, and
    ``loss(i, v)`` the scalar loss of step i as a function of the model output ``v`` at (x[i], sigma[i]).
    ``jagg.GRPOStepLoss`` is one; an engine's loss is another (``jagg.integrations.unirl``)."""

    x: Tensor
    sigma: Tensor

    def __call__(self, i: int, v: Tensor) -> Tensor: ...


@dataclass(kw_only=True)
class GroupStats:
    """What one backward (``interpolated_backward``) did. Counts are per call; ``loss`` is sum_j L_j over computed
    steps.

    Passes are counted in units of one model evaluation on the micro-batch (B samples): a batched endpoint
    forward over 2B samples is 2 forward passes in 1 call and its backward is 2 backward passes through 1 graph.
    """

    strategy: str
    group_size: int
    loss: float
    step_losses: list[float]
    forward_passes: int  # model forwards (with or without autograd), B-sample units
    forward_passes_with_grad: int
    forward_calls: int  # model invocations
    backward_passes: int  # B-sample units of transformer backward
    backward_graphs: int  # model graphs back-propagated
    backward_calls: int  # autograd backward invocations
    forwards_skipped: int = 0  # forwards replaced by stored (rollout) outputs
    time_forward_s: float = 0.0
    time_backward_s: float = 0.0  # transformer backward (the part JAGG saves)
    graph_mode: str = ""  # of an aggregated strategy ("" for exact)

    @classmethod
    def exact(cls, step_losses: list[float], *, time_forward_s: float, time_backward_s: float) -> GroupStats:
        """The exact per-step backward of W = len(step_losses) steps: W forwards with autograd in W calls,
        W backward passes through W graphs in W calls."""
        w = len(step_losses)
        return cls(
            strategy="exact",
            group_size=w,
            loss=sum(step_losses),
            step_losses=step_losses,
            forward_passes=w,
            forward_passes_with_grad=w,
            forward_calls=w,
            backward_passes=w,
            backward_graphs=w,
            backward_calls=w,
            time_forward_s=time_forward_s,
            time_backward_s=time_backward_s,
        )

    def as_metrics(self) -> dict[str, float]:
        """The pass counts and the forward / backward seconds, under the names ``metrics.jsonl`` uses."""
        names = ("forward_passes", "forward_passes_with_grad", "forward_calls", "forwards_skipped")
        names += ("backward_passes", "backward_graphs", "backward_calls", "time_forward_s", "time_backward_s")
        return {name: getattr(self, name) for name in names}

    def merge(self, other: GroupStats) -> GroupStats:
        """Sum of two stats (used to accumulate over the groups of a trajectory)."""
        summed = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name not in ("strategy", "graph_mode")
        }
        return GroupStats(
            strategy=self.strategy if self.strategy == other.strategy else "mixed",
            graph_mode=self.graph_mode
            if self.graph_mode == other.graph_mode
            else "/".join(sorted({self.graph_mode, other.graph_mode} - {""})),
            **summed,
        )


class _Timer:
    """Wall-clock accumulator; synchronises CUDA so GPU timings are real."""

    def __init__(self) -> None:
        self.total = 0.0

    def __enter__(self) -> _Timer:
        _sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        _sync()
        self.total += time.perf_counter() - self._t0


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def expert_boundaries(velocity: Velocity) -> tuple[float, ...]:
    """The sigmas at which ``velocity`` switches network (Wan2.2-A14B's two experts: ``Backbone.bind`` carries
    them); () for one network. Knots and groups are kept from straddling them (``jagg.engine.knots``)."""
    return tuple(getattr(velocity, "expert_boundaries", ()))


# --------------------------------------------------------------------------- aggregation weights
def t_weights(sigmas: Tensor) -> Tensor:
    """alpha_j = (t_0 - t_j) / (t_0 - t_{W-1}) for sigmas of shape (W,) or per-sample (W, B)."""
    return (sigmas[0] - sigmas) / (sigmas[0] - sigmas[-1])


def jagg_weights(sigmas: Tensor) -> Tensor:
    """JAGG: step j's signal goes (1 - alpha_j) to the first endpoint and alpha_j to the last."""
    alpha = t_weights(sigmas)
    return torch.stack([1 - alpha, alpha], dim=1)  # (W, 2) or (W, 2, B)


def jagg_index_weights(sigmas: Tensor) -> Tensor:
    """JAGG as the authors' code weights it: alpha_j = j / (W - 1), the step index instead of the time.

    Follows SchumiDing/eff_grpo ``fastvideo/train_grpo_qwenimage_jagg.py`` : ``grpo_group_backward`` (commit
    ae14d64, ``alpha = torch.linspace(0, 1, W)``). Equal to ``jagg_weights`` where the group's times are evenly
    spaced; under a shifted schedule they are not, and Theorem 1's exactness needs the t-weights.
    """
    w = sigmas.shape[0]
    alpha = torch.arange(w, dtype=sigmas.dtype, device=sigmas.device) / (w - 1)
    alpha = alpha.view(w, *([1] * (sigmas.ndim - 1))).expand(sigmas.shape)  # per-sample: same for every b
    return torch.stack([1 - alpha, alpha], dim=1)  # (W, 2) or (W, 2, B)


def endpoints_weights(sigmas: Tensor) -> Tensor:
    """Ablation (a): each endpoint gets only its own step's signal; intermediate signals are dropped."""
    w = torch.zeros(sigmas.shape[0], 2, *sigmas.shape[1:], dtype=sigmas.dtype, device=sigmas.device)
    w[0, 0] = 1
    w[-1, 1] = 1
    return w


def uniform_weights(sigmas: Tensor) -> Tensor:
    """Ablation (b): every step's signal split equally onto both endpoints (no t-weights)."""
    return torch.full((sigmas.shape[0], 2, *sigmas.shape[1:]), 0.5, dtype=sigmas.dtype, device=sigmas.device)


# name -> weight rule. "exact" is the per-step baseline and has no weights.
AGGREGATION_WEIGHTS: dict[str, Callable[[Tensor], Tensor]] = {
    "jagg": jagg_weights,
    "endpoints": endpoints_weights,
    "uniform": uniform_weights,
    "jagg_index": jagg_index_weights,
}
STRATEGIES: tuple[str, ...] = ("exact", *AGGREGATION_WEIGHTS)


def exact_at_two(strategy: str) -> bool:
    """Whether ``strategy`` gives the exact gradient on a group of two steps: its weight matrix for W = 2 is the
    identity (each endpoint gets exactly its own step's signal), as for JAGG (alpha = (0, 1)) and the
    endpoints ablation, not for uniform. Computed from the weight rule at two different pairs of times."""
    if strategy == "exact":
        return True
    if strategy not in AGGREGATION_WEIGHTS:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    rule = AGGREGATION_WEIGHTS[strategy]
    eye = torch.eye(2, dtype=torch.float64)
    pairs = (torch.tensor([1.0, 0.5], dtype=torch.float64), torch.tensor([0.9, 0.2], dtype=torch.float64))
    return all(torch.equal(rule(sigmas), eye) for sigmas in pairs)


# --------------------------------------------------------------------------- the backward as one matrix
@dataclass(frozen=True)
class GraphMode:
    """How the knot graphs of one block are built and back-propagated (same gradient, different cost).

    ``stacked``: the knots of a chunk run in ONE forward over their stacked rows (per-sample t, conditioning
    tiled), else one forward per knot. ``chunk``: knots per chunk, each chunk's graphs back-propagated in one
    call before the next chunk's forward (None: the whole block, or ``max_rows`` rows where that is given).
    """

    stacked: bool
    chunk: int | None


GRAPH_MODES: dict[str, GraphMode] = {
    "batched": GraphMode(stacked=True, chunk=None),
    "joint": GraphMode(stacked=False, chunk=None),
    "sequential": GraphMode(stacked=True, chunk=1),
}
"""How a block's knot backward runs (``backward.graph_mode``; for a JAGG group the knots are its two endpoints):

    batched     the block's knots in ONE forward over their stacked rows [z_k0; z_k1; ...] (per-sample t,
                conditioning tiled), one graph, one backward (chunks of ``backward.max_rows`` rows where set).
                Under FSDP2 each unit is gathered once in forward and once in backward and reduce-scattered
                once per chunk. (default)
    joint       the paper's recipe: one forward with autograd per knot, one ``autograd.backward`` over all of
                them. K graphs alive; under FSDP2 each unit is gathered K times in backward.
    sequential  one knot graph alive at a time: forward, backward, free. Peak saved activations equal the exact
                baseline's; one reduce-scatter per knot under FSDP2.
"""

ENDPOINT_SIGNALS: tuple[str, ...] = ("graph", "nograd")
"""Where the knots' own signals come from (same gradient, different forward count):

    graph   from the knot forwards that build the graphs (for a JAGG group: W forwards without stored outputs).
    nograd  as the JAGG authors' code computes them (SchumiDing/eff_grpo ae14d64, ``grpo_group_backward``):
            every step's signal from its own forward without autograd, knots included, then the knots
            forwarded again with autograd for the backward (W + 2 forwards per JAGG group).
"""
# The defaults, named once; ``GraphRun``'s fields are the one place that uses them.
DEFAULT_MODE, DEFAULT_SIGNALS = "batched", "graph"


@dataclass(frozen=True)
class Interpolation:
    """The backward of T time-sorted trained steps as one matrix: the gradient

        sum_k J_{knots[k]}^T g_k,    g_k = sum_j weights[j, k] s_j,    s_j = dL_j / dv_j,

    approximates (or, where the weights say so, equals) the exact  sum_j J_j^T s_j. Exact is the identity; a
    JAGG group is a (W, 2) block; knots are hat functions of t (``jagg.engine.knots``).

    knots: (K,) positions of the knot steps among the T steps, ascending.
    weights: (T, K) or per-sample (T, K, B), float64, kept on the CPU whatever device the times it was built
        from live on: it is small, its structure (``feeding``, ``is_plain``) is read without a device sync, and
        ``knot_signal`` moves each weight it uses to its signal's device. A step whose row is zero needs no
        signal (no forward).
    blocks: knot indices back-propagated together (one pass of ``GRAPH_MODES``), in order, covering 0..K-1
        once. A block of one knot fed only by its own step with weight 1 is a plain step: forward, loss,
        backward, exactly as DanceGRPO / Flow-GRPO train (it never reads stored outputs).
    name: the strategy, for the stats.
    """

    knots: tuple[int, ...]
    weights: Tensor
    blocks: tuple[tuple[int, ...], ...]
    name: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", self.weights.detach().to("cpu", torch.float64))
        t, k = self.weights.shape[:2]
        if len(self.knots) != k or list(self.knots) != sorted(set(self.knots)) or min(self.knots) < 0:
            raise ValueError(f"knots must be {k} ascending distinct step positions, got {self.knots}")
        if max(self.knots) >= t or sorted(i for b in self.blocks for i in b) != list(range(k)):
            raise ValueError(
                f"blocks {self.blocks} must cover the {k} knots once, and knots lie in 0..{t - 1}"
            )

    @property
    def num_steps(self) -> int:
        return self.weights.shape[0]

    def feeding(self, block: Sequence[int]) -> list[int]:
        """The steps whose signal reaches a knot of ``block`` (non-zero weight for some sample)."""
        used = (self.weights[:, list(block)] != 0).flatten(1).any(dim=1)
        return [j for j in range(self.num_steps) if bool(used[j])]

    def is_plain(self, block: Sequence[int]) -> bool:
        """A one-knot block fed by its own step alone with weight 1: an ordinary per-step backward."""
        if len(block) != 1:
            return False
        j = self.knots[block[0]]
        return self.feeding(block) == [j] and bool((self.weights[j, block[0]] == 1).all())

    @classmethod
    def identity(cls, num_steps: int, name: str = "exact") -> Interpolation:
        """The exact per-step backward: every step a knot of its own, one block per step."""
        eye = torch.eye(num_steps, dtype=torch.float64)
        return cls(tuple(range(num_steps)), eye, tuple((k,) for k in range(num_steps)), name)

    @classmethod
    def group(cls, weights: Tensor, name: str) -> Interpolation:
        """One group of W steps whose (W, 2[, B]) weights map every signal onto its two endpoints."""
        return cls((0, weights.shape[0] - 1), weights, ((0, 1),), name)

    @classmethod
    def stack(cls, parts: Sequence[Interpolation], name: str) -> Interpolation:
        """Block-diagonal: ``parts`` cover consecutive runs of steps (a trajectory cut into groups)."""
        t = sum(p.num_steps for p in parts)
        k = sum(len(p.knots) for p in parts)
        per_sample = [p.weights.shape[2:] for p in parts if p.weights.ndim == 3]
        tail = per_sample[0] if per_sample else ()
        weights = torch.zeros(t, k, *tail, dtype=torch.float64)
        knots, blocks, j0, k0 = [], [], 0, 0
        for p in parts:
            w = p.weights if p.weights.ndim == len(tail) + 2 else p.weights.view(*p.weights.shape, 1)
            weights[j0 : j0 + p.num_steps, k0 : k0 + len(p.knots)] = w
            knots += [j0 + i for i in p.knots]
            blocks += [tuple(k0 + i for i in b) for b in p.blocks]
            j0, k0 = j0 + p.num_steps, k0 + len(p.knots)
        return cls(tuple(knots), weights, tuple(blocks), name)


def _check_steps(latents: Tensor, sigmas: Tensor) -> None:
    t = latents.shape[0]
    if sigmas.shape[0] != t or sigmas.ndim not in (1, 2):
        raise ValueError(f"sigmas must have shape (T,) or (T, B) with T = {t}, got {tuple(sigmas.shape)}")
    if sigmas.ndim == 2 and sigmas.shape[1] != latents.shape[1]:
        raise ValueError(f"per-sample sigmas {tuple(sigmas.shape)} do not match batch {latents.shape[1]}")
    if t > 1 and not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError("sigmas must be strictly decreasing within a group (t_0 > ... > t_{W-1})")


def _signal(step_loss: StepFn, j: int, v: Tensor) -> tuple[float, Tensor]:
    """(L_j, s_j = dL_j/dv_j) through a detached proxy of v_j: only the light SDE / PPO math is differentiated."""
    proxy = v.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = step_loss(j, proxy)
        (s_j,) = torch.autograd.grad(loss, proxy)
    return loss.item(), s_j


def _per_sample(t: Tensor, b: int) -> Tensor:
    return t.expand(b) if t.ndim == 0 else t


class _Run:
    """One ``interpolated_backward``: the signals computed so far, the counts and the timers."""

    def __init__(
        self,
        velocity,
        latents,
        sigmas,
        step_loss,
        outputs,
        plan: Interpolation,
        backward_fn: BackwardFn = autograd_backward,
    ) -> None:
        self.velocity, self.latents, self.sigmas, self.step_loss = velocity, latents, sigmas, step_loss
        self.outputs, self.plan, self.backward_fn = outputs, plan, backward_fn
        self.losses: dict[int, float] = {}
        self.signals: dict[int, Tensor] = {}
        self.n = dict(fwd=0, fwd_grad=0, calls=0, skipped=0, bwd=0, graphs=0, bwd_calls=0)
        self.t_fwd, self.t_bwd = _Timer(), _Timer()

    def forward(self, z: Tensor, t: Tensor, grad: bool, passes: int = 1) -> Tensor:
        with self.t_fwd, torch.set_grad_enabled(grad):
            v = self.velocity(z, t)
        self.n["fwd"] += passes
        self.n["fwd_grad"] += passes * grad
        self.n["calls"] += 1
        return v

    def backward(self, tensors: list[Tensor], grads: list[Tensor], passes: int) -> None:
        with self.t_bwd:
            self.backward_fn(tensors, [g.to(t.dtype) for g, t in zip(grads, tensors)])
        self.n["bwd"] += passes
        self.n["graphs"] += len(tensors)
        self.n["bwd_calls"] += 1

    def signal(self, j: int, v: Tensor | None = None) -> None:
        """s_j, once per step: from the stored outputs when given (the rollout's own numbers, so on-policy
        ratios stay exactly 1), else from ``v``, else from a forward without autograd."""
        if j in self.signals:
            return
        if self.outputs is not None:
            self.n["skipped"] += v is None
            v = self.outputs[j]
        elif v is None:
            v = self.forward(self.latents[j], self.sigmas[j], grad=False)
        self.losses[j], self.signals[j] = _signal(self.step_loss, j, v)

    def knot_signal(self, k: int) -> Tensor:
        """g_k = sum_j w[j, k] s_j in step order; per-sample weights (B,) broadcast over each sample's elements."""
        total = None
        for j in sorted(self.signals):
            w_jk = self.plan.weights[j, k]
            if not bool((w_jk != 0).any()):
                continue
            s_j = self.signals[j]
            w_jk = w_jk.to(s_j.device, s_j.dtype)  # a per-sample (B,) weight must be on the signal's device
            if w_jk.ndim == 1:  # per-sample weight: (B,) -> (B, 1, ...)
                w_jk = w_jk.view(-1, *([1] * (s_j.ndim - 1)))
            total = w_jk * s_j if total is None else total + w_jk * s_j
        return total

    def plain_step(self, j: int) -> None:
        """Forward with autograd, the step's loss, its backward (the exact baseline)."""
        v = self.forward(self.latents[j], self.sigmas[j], grad=True)
        loss = self.step_loss(j, v)
        self.backward([loss], [torch.ones_like(loss)], passes=1)
        self.losses[j] = loss.item()

    def block(
        self, block: Sequence[int], mode: GraphMode, endpoint_signals: str, max_rows: int | None
    ) -> None:
        """The knot backward of one block: signals, knot signals, the knots' forwards with autograd, backward."""
        plan = self.plan
        if plan.is_plain(block):
            self.plain_step(plan.knots[block[0]])
            return
        knots = {plan.knots[k] for k in block}
        for j in plan.feeding(block):  # signals that need no graph: every one under "nograd"
            if endpoint_signals == "nograd" or j not in knots:
                self.signal(j)
        b = self.latents.shape[1]
        size = mode.chunk or (max(1, max_rows // b) if mode.stacked and max_rows else len(block))
        chunks = [tuple(block[i : i + size]) for i in range(0, len(block), size)]
        for c, chunk in enumerate(chunks):
            later = {plan.knots[k] for rest in chunks[c + 1 :] for k in rest}
            for j in later.intersection(
                plan.feeding(chunk)
            ):  # a later knot's signal, needed before its graph
                self.signal(j)
            outs = self._knot_forwards(chunk, mode.stacked)
            grads = [torch.cat([self.knot_signal(k) for k in ks]) for ks, _ in outs]
            self.backward([v for _, v in outs], grads, passes=len(chunk))

    def _knot_forwards(self, chunk: tuple[int, ...], stacked: bool) -> list[tuple[tuple[int, ...], Tensor]]:
        """The chunk's knot outputs with autograd: one forward over the stacked rows [z_k0; z_k1; ...] (per-sample
        t), or one forward per knot; each knot's own signal from its output. Returns (knots, output) pairs."""
        steps = [self.plan.knots[k] for k in chunk]
        b = self.latents.shape[1]
        if stacked and len(chunk) > 1:
            z = torch.cat([self.latents[j] for j in steps])  # (n B, ...)
            t = torch.cat([_per_sample(self.sigmas[j], b) for j in steps])  # (n B,)
            v = self.forward(z, t, grad=True, passes=len(chunk))
            for i, j in enumerate(steps):
                self.signal(j, v[i * b : (i + 1) * b])
            return [(chunk, v)]
        outs = []
        for k, j in zip(chunk, steps):
            v = self.forward(self.latents[j], self.sigmas[j], grad=True)
            self.signal(j, v)
            outs.append(((k,), v))
        return outs

    def stats(self, graph_mode: str) -> GroupStats:
        plain = all(self.plan.is_plain(b) for b in self.plan.blocks)
        step_losses = [self.losses[j] for j in sorted(self.losses)]
        n = self.n
        return GroupStats(
            strategy="exact" if plain else self.plan.name,
            group_size=self.plan.num_steps,
            loss=sum(step_losses),
            step_losses=step_losses,
            forward_passes=n["fwd"],
            forward_passes_with_grad=n["fwd_grad"],
            forward_calls=n["calls"],
            backward_passes=n["bwd"],
            backward_graphs=n["graphs"],
            backward_calls=n["bwd_calls"],
            forwards_skipped=n["skipped"],
            time_forward_s=self.t_fwd.total,
            time_backward_s=self.t_bwd.total,
            graph_mode="" if plain else graph_mode,
        )


def interpolated_backward(
    velocity: Velocity,
    latents: Tensor,
    sigmas: Tensor,
    step_loss: StepFn,
    plan: Interpolation,
    *,
    graph_mode: str,
    endpoint_signals: str,
    outputs: Tensor | None = None,
    max_rows: int | None = None,
    backward_fn: BackwardFn = autograd_backward,
) -> GroupStats:
    """ADD  sum_k J_{knots[k]}^T g_k  (``Interpolation``) for T time-sorted steps to the parameters' ``.grad``.

    Args:
        velocity: ``velocity(z, t)``, differentiable in the trained parameters; z (B, ...), t scalar or (B,).
            Stacked knot forwards call it on n B rows with per-sample t; it must tile its conditioning
            (``Backbone.velocity`` does).
        latents: (T, B, ...) the stored model inputs of the steps; sigmas: (T,) or (T, B), strictly decreasing.
        step_loss: ``step_loss(j, v_j)`` -> scalar loss of step j as a function of its model output.
        plan: the knots, the (T, K[, B]) weights and the blocks.
        graph_mode: a key of ``GRAPH_MODES``: how each block's knot graphs run.
        endpoint_signals: one of ``ENDPOINT_SIGNALS``.
        outputs: optional (T, B, ...) model outputs at these inputs under the CURRENT parameters (the rollout's,
            before the first optimizer step): every signal then comes from them and non-knot steps need no
            forward. Plain steps ignore them (they differentiate their own forward).
        max_rows: at most this many rows per stacked forward (``backward.max_rows``; None: a whole block).
        backward_fn: every backward call goes through it (``BackwardFn``; default ``autograd_backward``).
    Each step's ``step_loss`` is evaluated exactly once; blocks run in order.
    """
    if graph_mode not in GRAPH_MODES:
        raise ValueError(f"graph_mode must be one of {tuple(GRAPH_MODES)}, got {graph_mode!r}")
    if endpoint_signals not in ENDPOINT_SIGNALS:
        raise ValueError(f"endpoint_signals must be one of {ENDPOINT_SIGNALS}, got {endpoint_signals!r}")
    sigmas = torch.as_tensor(sigmas)
    _check_steps(latents, sigmas)
    if plan.num_steps != latents.shape[0]:
        raise ValueError(f"the plan has {plan.num_steps} steps, the latents {latents.shape[0]}")
    if outputs is not None and outputs.shape != latents.shape:
        raise ValueError(
            f"outputs must have the latents' shape {tuple(latents.shape)}, got {tuple(outputs.shape)}"
        )
    run = _Run(velocity, latents, sigmas, step_loss, outputs, plan, backward_fn)
    for block in plan.blocks:
        run.block(block, GRAPH_MODES[graph_mode], endpoint_signals, max_rows)
    return run.stats(graph_mode)


def group_interpolation(strategy: str, sigmas: Tensor) -> Interpolation:
    """One group of W steps as a plan: the identity for exact (and for a single step), else the strategy's
    (W, 2[, B]) weight rule onto the two endpoints (``AGGREGATION_WEIGHTS``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "exact" or sigmas.shape[0] == 1:
        return Interpolation.identity(sigmas.shape[0])
    return Interpolation.group(
        AGGREGATION_WEIGHTS[strategy](torch.as_tensor(sigmas).to(torch.float64)), strategy
    )


@dataclass(frozen=True, kw_only=True)
class GraphRun:
    """How ``interpolated_backward`` runs a plan: the same gradient at different costs. ``graph_mode`` (a key
    of ``GRAPH_MODES``, ``backward.graph_mode``) builds the knot graphs, ``endpoint_signals`` (one of
    ``ENDPOINT_SIGNALS``) says where the knots' own signals come from, ``max_rows`` bounds the rows of a stacked
    forward (``backward.max_rows``; None: a whole block), ``backward_fn`` is what each backward call goes through
    (``BackwardFn``: autograd, or an engine's, e.g. ``jagg.integrations.accelerate_backward``; not a config key).

    The defaults are written here and nowhere else: ``BackwardSetting`` (a ``GraphRun`` bound to a routing), the
    config's ``backward`` section and the gradient diagnostics all take them from this class."""

    graph_mode: str = DEFAULT_MODE
    endpoint_signals: str = DEFAULT_SIGNALS
    max_rows: int | None = None
    backward_fn: BackwardFn = field(default=autograd_backward, repr=False)

    def __post_init__(self) -> None:
        if not callable(self.backward_fn):
            raise ValueError(
                f"backward_fn must be callable as backward_fn(tensors, grads), got {self.backward_fn!r}"
            )
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(
                f"backward.graph_mode must be one of {tuple(GRAPH_MODES)}, got {self.graph_mode!r}"
            )
        if self.endpoint_signals not in ENDPOINT_SIGNALS:
            raise ValueError(
                f"backward.endpoint_signals must be one of {ENDPOINT_SIGNALS}, got {self.endpoint_signals!r}"
            )
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"backward.max_rows must be a positive integer or null, got {self.max_rows!r}")

    def run_plan(
        self,
        plan: Interpolation,
        velocity: Velocity,
        latents: Tensor,
        sigmas: Tensor,
        step_loss: StepFn,
        outputs: Tensor | None = None,
    ) -> GroupStats:
        """``interpolated_backward`` of ``plan`` run this way (args as there)."""
        return interpolated_backward(
            velocity,
            latents,
            sigmas,
            step_loss,
            plan,
            graph_mode=self.graph_mode,
            endpoint_signals=self.endpoint_signals,
            outputs=outputs,
            max_rows=self.max_rows,
            backward_fn=self.backward_fn,
        )
