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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

# velocity(z, t) -> v : z (B, ...), t scalar tensor or (B,) ; v (B, ...)
Velocity = Callable[[Tensor, Tensor], Tensor]
# step_loss(j, v_j) -> scalar loss of step j of the group
StepLoss = Callable[[int, Tensor], Tensor]


@dataclass(kw_only=True)
class GroupStats:
    """What one ``group_backward`` did. Counts are per call; ``loss`` is sum_j L_j over computed steps.

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
    endpoints: str = ""  # endpoint mode of an aggregated strategy ("" for exact)

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
            if f.name not in ("strategy", "endpoints")
        }
        return GroupStats(
            strategy=self.strategy if self.strategy == other.strategy else "mixed",
            endpoints=self.endpoints
            if self.endpoints == other.endpoints
            else "/".join(sorted({self.endpoints, other.endpoints} - {""})),
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


# --------------------------------------------------------------------------- strategies
ENDPOINT_MODES: tuple[str, ...] = ("batched", "joint", "sequential")
"""How the two endpoint backward passes of an aggregated group run (same gradient, different cost):

    batched     both endpoints in ONE forward over the concatenated batch [z_0; z_{W-1}] (2B samples, per-sample
                t, conditioning tiled), one graph, one backward with the upstream [g_0; g_1]. Under FSDP2 each
                unit is gathered once in forward and once in backward and reduce-scattered once. (default)
    joint       the paper's recipe: two forwards with autograd, one ``autograd.backward([v_0, v_{W-1}], [g_0, g_1])``.
                Two graphs alive; under FSDP2 each unit is gathered twice in backward and the later graph's
                gradient waits unsharded until the earlier graph reaches the unit.
    sequential  one graph alive at a time: forward v_0, backward(g_0), free; forward v_{W-1}, backward(g_1).
                Peak saved activations equal the exact baseline's; two reduce-scatters per unit under FSDP2.
"""

ENDPOINT_SIGNALS: tuple[str, ...] = ("graph", "nograd")
"""Where the two endpoints' own signals s_0, s_{W-1} come from (same gradient, different forward count):

    graph   from the endpoint forwards that build the graphs (W forwards per group without stored outputs).
    nograd  as the JAGG authors' code computes them (SchumiDing/eff_grpo ae14d64, ``grpo_group_backward``):
            every step's signal from its own forward without autograd, endpoints included, then both endpoints
            forwarded again with autograd for the backward: W + 2 forwards per group.
"""


def _check_group(latents: Tensor, sigmas: Tensor) -> None:
    w = latents.shape[0]
    if sigmas.shape[0] != w or sigmas.ndim not in (1, 2):
        raise ValueError(f"sigmas must have shape (W,) or (W, B) with W = {w}, got {tuple(sigmas.shape)}")
    if sigmas.ndim == 2 and sigmas.shape[1] != latents.shape[1]:
        raise ValueError(f"per-sample sigmas {tuple(sigmas.shape)} do not match batch {latents.shape[1]}")
    if w > 1 and not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError("sigmas must be strictly decreasing within a group (t_0 > ... > t_{W-1})")


def exact_backward(velocity: Velocity, latents: Tensor, sigmas: Tensor, step_loss: StepLoss) -> GroupStats:
    """Baseline: for every step one forward with autograd and one backward (DanceGRPO / Flow-GRPO)."""
    t_fwd, t_bwd = _Timer(), _Timer()
    losses = []
    for j in range(latents.shape[0]):
        with t_fwd:
            v = velocity(latents[j], sigmas[j])
        loss = step_loss(j, v)
        with t_bwd:
            torch.autograd.backward(loss)
        losses.append(loss.item())
    return GroupStats.exact(losses, time_forward_s=t_fwd.total, time_backward_s=t_bwd.total)


def _signal(step_loss: StepLoss, j: int, v: Tensor) -> tuple[float, Tensor]:
    """(L_j, s_j = dL_j/dv_j) through a detached proxy of v_j: only the light SDE / PPO math is differentiated."""
    proxy = v.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = step_loss(j, proxy)
        (s_j,) = torch.autograd.grad(loss, proxy)
    return loss.item(), s_j


def _aggregate(weights: Tensor, signals: dict[int, Tensor], k: int) -> Tensor:
    """g_k = sum_j w[j, k] s_j in step order; per-sample weights (B,) broadcast over each sample's elements."""
    total = None
    for j in sorted(signals):
        s_j = signals[j]
        w_jk = weights[j, k].to(s_j.dtype)
        if w_jk.ndim == 1:  # per-sample alpha: (B,) -> (B, 1, ...)
            w_jk = w_jk.view(-1, *([1] * (s_j.ndim - 1)))
        total = w_jk * s_j if total is None else total + w_jk * s_j
    return total


def _per_sample(t: Tensor, b: int) -> Tensor:
    return t.expand(b) if t.ndim == 0 else t


def aggregated_backward(
    velocity: Velocity,
    latents: Tensor,
    sigmas: Tensor,
    step_loss: StepLoss,
    weights: Tensor,
    name: str,
    *,
    endpoints: str = "batched",
    outputs: Tensor | None = None,
    endpoint_signals: str = "graph",
) -> GroupStats:
    """Two-endpoint backward with per-step signals mapped onto the endpoints by ``weights`` (W, 2[, B]).

    1. s_j = dL_j/dv_j for every step whose weight row is non-zero, through a detached proxy of v_j (only the
       light SDE / PPO math is differentiated). With ``outputs`` every v_j is the stored one (intermediate
       steps need no model forward; the endpoint forwards only provide the graphs), else intermediate v_j
       come from forwards without autograd and endpoint v_j from the endpoint forwards.
    2. g_0 = sum_j w[j, 0] s_j,  g_1 = sum_j w[j, 1] s_j.
    3. Backward g_0 through v_0 and g_1 through v_{W-1}, as ``endpoints`` says (``ENDPOINT_MODES``).
    Each step's ``step_loss`` is evaluated exactly once. ``endpoint_signals="nograd"`` (``ENDPOINT_SIGNALS``)
    takes the endpoints' signals in step 1 too, from their own forwards without autograd.
    """
    if endpoints not in ENDPOINT_MODES:
        raise ValueError(f"endpoints must be one of {ENDPOINT_MODES}, got {endpoints!r}")
    if endpoint_signals not in ENDPOINT_SIGNALS:
        raise ValueError(f"endpoint_signals must be one of {ENDPOINT_SIGNALS}, got {endpoint_signals!r}")
    w, b = latents.shape[0], latents.shape[1]
    last = w - 1
    t_fwd, t_bwd = _Timer(), _Timer()
    n = dict(fwd=0, fwd_grad=0, calls=0, skipped=0)
    losses: dict[int, float] = {}
    signals: dict[int, Tensor] = {}

    def forward(z: Tensor, t: Tensor, grad: bool, passes: int = 1) -> Tensor:
        with t_fwd, torch.set_grad_enabled(grad):
            v = velocity(z, t)
        n["fwd"] += passes
        n["fwd_grad"] += passes * grad
        n["calls"] += 1
        return v

    def detached_output(j: int) -> Tensor:
        if outputs is not None:
            n["skipped"] += 1
            return outputs[j]
        return forward(latents[j], sigmas[j], grad=False)

    def signal(j: int, v: Tensor) -> None:
        """s_j from ``outputs`` when given (the rollout's own numbers: on-policy ratios stay exactly 1),
        else from ``v``; computed once per step."""
        if j not in signals:
            losses[j], signals[j] = _signal(step_loss, j, outputs[j] if outputs is not None else v)

    def backward(tensors: list[Tensor], grads: list[Tensor]) -> None:
        with t_bwd:
            torch.autograd.backward(tensors, [g.to(t.dtype) for g, t in zip(grads, tensors)])

    detached_steps = range(w) if endpoint_signals == "nograd" else range(1, last)
    for j in detached_steps:
        if bool((weights[j] != 0).any()):
            signal(j, detached_output(j))
    if endpoints == "batched":
        z = torch.cat([latents[0], latents[last]])  # (2B, ...)
        t = torch.cat([_per_sample(sigmas[0], b), _per_sample(sigmas[last], b)])  # (2B,)
        v = forward(z, t, grad=True, passes=2)
        signal(0, v[:b])
        signal(last, v[b:])
        backward([v], [torch.cat([_aggregate(weights, signals, 0), _aggregate(weights, signals, 1)])])
        graphs, calls = 1, 1
    elif endpoints == "joint":
        v_0 = forward(latents[0], sigmas[0], grad=True)
        signal(0, v_0)
        v_1 = forward(latents[last], sigmas[last], grad=True)
        signal(last, v_1)
        backward([v_0, v_1], [_aggregate(weights, signals, 0), _aggregate(weights, signals, 1)])
        graphs, calls = 2, 1
    else:  # sequential
        if last not in signals and bool((weights[last, 0] != 0).any()):  # g_0 needs s_{W-1} first
            signal(last, detached_output(last))
        v_0 = forward(latents[0], sigmas[0], grad=True)
        signal(0, v_0)
        backward([v_0], [_aggregate(weights, signals, 0)])
        del v_0  # its graph is freed before the second endpoint's forward
        v_1 = forward(latents[last], sigmas[last], grad=True)
        signal(last, v_1)
        backward([v_1], [_aggregate(weights, signals, 1)])
        graphs, calls = 2, 2
    step_losses = [losses[j] for j in sorted(losses)]
    return GroupStats(
        strategy=name,
        group_size=w,
        loss=sum(step_losses),
        step_losses=step_losses,
        forward_passes=n["fwd"],
        forward_passes_with_grad=n["fwd_grad"],
        forward_calls=n["calls"],
        backward_passes=2,
        backward_graphs=graphs,
        backward_calls=calls,
        forwards_skipped=n["skipped"],
        time_forward_s=t_fwd.total,
        time_backward_s=t_bwd.total,
        endpoints=endpoints,
    )


def group_backward(
    velocity: Velocity,
    latents: Tensor,
    sigmas: Tensor,
    step_loss: StepLoss,
    strategy: str,
    *,
    endpoints: str = "batched",
    outputs: Tensor | None = None,
    endpoint_signals: str = "graph",
) -> GroupStats:
    """ADD the (approximate) gradient of sum_j L_j over one group to the parameters' ``.grad``.

    Args:
        velocity: ``velocity(z, t)``, differentiable in the trained parameters; z (B, ...), t scalar or (B,).
            With ``endpoints="batched"`` it is called once on 2B rows (the two endpoints' latents stacked,
            per-sample t) and must tile its conditioning (``Backbone.velocity`` does).
        latents: (W, B, ...) the stored model inputs of the group's W steps.
        sigmas: (W,) or per-sample (W, B) times, strictly decreasing along the group.
        step_loss: ``step_loss(j, v_j)`` -> scalar loss of step j as a function of its model output.
        strategy: one of ``STRATEGIES``. A group of one step is always exact.
        endpoints: one of ``ENDPOINT_MODES`` (aggregated strategies only): how the endpoint backward runs.
        outputs: optional (W, B, ...) model outputs at these inputs under the CURRENT parameters (e.g. the
            rollout's, before the first optimizer step): intermediate signals then need no model forward.
            Ignored by the exact strategy, which always differentiates its own forwards.
        endpoint_signals: one of ``ENDPOINT_SIGNALS`` (aggregated strategies only): whether the endpoints'
            own signals come from the graph-building forwards or, as the authors' code does, from extra
            forwards without autograd.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    sigmas = torch.as_tensor(sigmas)
    _check_group(latents, sigmas)
    if outputs is not None and outputs.shape != latents.shape:
        raise ValueError(
            f"outputs must have the latents' shape {tuple(latents.shape)}, got {tuple(outputs.shape)}"
        )
    if strategy == "exact" or latents.shape[0] == 1:
        return exact_backward(velocity, latents, sigmas, step_loss)
    weights = AGGREGATION_WEIGHTS[strategy](sigmas.to(torch.float64))
    return aggregated_backward(
        velocity,
        latents,
        sigmas,
        step_loss,
        weights,
        strategy,
        endpoints=endpoints,
        outputs=outputs,
        endpoint_signals=endpoint_signals,
    )
