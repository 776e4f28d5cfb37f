"""FSDP2 on CPU (gloo, 2 processes): JAGG and exact gradients equal a single-process run on the global batch,
and JAGG's joint backward reduce-scatters once per sharded unit instead of W times (docs/method.md).

Each rank takes half of the global batch; the per-step loss is a mean over the local batch and FSDP2
averages gradients over the 2 ranks, so the sharded gradient equals the single-process gradient of the mean
over the global batch. The loss is the real one: SDE log-prob of the stored sample + clipped PPO.
"""

from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from dist_harness import rank_results, run_ranks, save_rank_result

W, B_GLOBAL, WORLD = 4, 4, 2


def _problem():
    """A group of W trained steps of a sampled DanceGRPO-style trajectory (identical on every rank)."""
    from jagg.engine.grpo import clipped_ppo_loss
    from jagg.engine.sampling import sample_trajectory
    from jagg.engine.sde import sde_step_with_logprob, shifted_linear_sigmas
    from jagg.models import TextCond, build_tiny_backbone

    model = build_tiny_backbone("flux", seed=0)
    g = torch.Generator().manual_seed(0)
    cond = TextCond(embeds=torch.randn(B_GLOBAL, 5, 32, generator=g))
    sigmas = shifted_linear_sigmas(6, shift=3.0).float()
    traj = sample_trajectory(
        model.bind(cond),
        torch.randn(B_GLOBAL, 16, 8, 8, generator=g),
        sigmas,
        ["dance"] * 6,
        noise_level=0.3,
        generator=g,
    )
    adv = torch.randn(B_GLOBAL, generator=g)

    def group(rows):
        """(velocity-less) group data and the step loss for the batch rows ``rows``."""
        lat, nxt, old = traj.latents[:W, rows], traj.latents[1 : W + 1, rows], traj.log_probs[:W, rows]

        def step_loss(j, v):
            lp = sde_step_with_logprob(
                lat[j], v, sigmas[j], sigmas[j + 1], kind="dance", noise_level=0.3, prev_sample=nxt[j]
            ).log_prob
            return clipped_ppo_loss(lp, old[j], adv[rows], clip_range=1e-4)[0]

        return lat, sigmas[:W], cond.select(rows), step_loss

    return model, group


# (strategy, graph mode, stored outputs): exact, the paper-literal JAGG, and the two new modes (stored outputs:
# the rollout's intermediate outputs, so only the endpoint forwards run).
VARIANTS = [
    ("exact", "batched", False),
    ("jagg", "joint", False),
    ("jagg", "batched", True),
    ("jagg", "sequential", True),
]


def key_of(strategy: str, graph_mode: str, stored: bool, rab: bool) -> str:
    return f"{strategy}/{graph_mode}/stored={stored}/reshard_after_backward={rab}"


@contextmanager
def count_post_backward():
    """Calls of FSDP2's per-unit post-backward (torch-private; test only). More than one call per unit in a
    single backward means the unit's gradient was computed in pieces and held unsharded in between."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group

    calls: Counter = Counter()
    original = fsdp_group.FSDPParamGroup.post_backward

    def counted(self, *args, **kwargs):
        calls[id(self)] += 1
        return original(self, *args, **kwargs)

    fsdp_group.FSDPParamGroup.post_backward = counted
    try:
        yield calls
    finally:
        fsdp_group.FSDPParamGroup.post_backward = original


def _outputs(velocity, lat, sig):
    with torch.no_grad():
        return torch.stack([velocity(lat[j], sig[j]) for j in range(lat.shape[0])])


def fsdp_worker(rank: int, out_dir: str) -> None:
    """One rank (run by ``dist_harness.run_ranks``, which owns the process group)."""
    from helpers import Steps, one_group
    from jagg.scale.distributed import CollectiveCounter, fsdp_units, full_grads, shard_backbone

    rows = list(range(rank * B_GLOBAL // WORLD, (rank + 1) * B_GLOBAL // WORLD))
    result = {}
    for strategy, graph_mode, stored in VARIANTS:
        setting = one_group(strategy, W, graph_mode=graph_mode)
        # single-process reference on the global batch
        ref, group = _problem()
        lat, sig, cond, loss = group(list(range(B_GLOBAL)))
        outputs = _outputs(ref.bind(cond), lat, sig) if stored else None
        setting.backward(ref.bind(cond), Steps(lat, sig, loss), outputs)
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for reshard_after_backward in (True, False):
            sharded, group = _problem()
            shard_backbone(sharded)
            units = fsdp_units(sharded)
            for u in units:
                u.set_reshard_after_backward(reshard_after_backward, recurse=False)
            lat, sig, cond, loss = group(rows)
            velocity = sharded.bind(cond)
            outputs = _outputs(velocity, lat, sig) if stored else None  # the rollout's, not counted
            with CollectiveCounter() as counts, count_post_backward() as post:
                setting.backward(velocity, Steps(lat, sig, loss), outputs)
            grads = full_grads(sharded)
            diff = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
            scale = max(g.abs().max().item() for g in ref_grads.values())
            result[key_of(strategy, graph_mode, stored, reshard_after_backward)] = dict(
                counts=dict(counts),
                units=len(units),
                post_backward=sorted(post.values()),
                max_abs_diff=diff,
                max_abs_grad=scale,
            )
        torch.save(ref_grads, os.path.join(out_dir, f"ref_{strategy}_{graph_mode}_{rank}.pt"))
    save_rank_result(out_dir, rank, result)


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    out = run_ranks("test_distributed:fsdp_worker", WORLD, tmp_path_factory.mktemp("fsdp"))
    return rank_results(out, WORLD), out


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-{v[1]}-stored{v[2]}")
def test_fsdp_grads_equal_single_process(fsdp_results, variant):
    results, _ = fsdp_results
    for res in results:
        for rab in (True, False):
            r = res[key_of(*variant, rab)]
            assert r["max_abs_diff"] <= 1e-6 * max(1.0, r["max_abs_grad"]), r


def test_collectives_per_unit_and_mode(fsdp_results):
    """Per sharded unit and group (reshard after forward and backward, W = 4):
    exact        W all-gathers in forward + W in backward, W reduce-scatters;
    jagg/joint   (the paper's recipe) one reduce-scatter, but two post-backward calls per block: autograd
                 finishes the later endpoint's graph first and that gradient waits unsharded for the other;
    jagg/batched one all-gather in forward, one in backward, one reduce-scatter, one post-backward;
    jagg/sequential two of each (one graph alive at a time: the memory-lean trade-off)."""
    results, _ = fsdp_results
    for res in results:
        r = {v: res[key_of(*v, True)] for v in VARIANTS}
        units = r[VARIANTS[0]]["units"]
        assert units == 5  # tiny Flux: 2 double-stream + 2 single-stream blocks + root
        rs = {v: x["counts"]["reduce_scatter_single"] for v, x in r.items()}
        ag = {v: x["counts"]["all_gather_single"] for v, x in r.items()}
        post = {v: x["post_backward"] for v, x in r.items()}
        exact, joint, batched, sequential = VARIANTS
        assert all("all_reduce" not in x["counts"] for x in r.values())
        assert rs[exact] == W * units and ag[exact] == 2 * W * units
        assert rs[joint] == units
        assert max(post[joint]) == 2  # the held gradient
        assert rs[batched] == units and ag[batched] == 2 * units and post[batched] == [1] * units
        assert rs[sequential] == 2 * units and ag[sequential] == 4 * units
        # keeping units unsharded after backward trades memory for fewer all-gathers
        for v in VARIANTS:
            assert res[key_of(*v, False)]["counts"]["all_gather_single"] <= ag[v]


def test_jagg_differs_from_exact(fsdp_results):
    """Non-trivial check: W = 4 on a non-linear model, JAGG is an approximation (cosine < 1 but > 0)."""
    _, out = fsdp_results
    a, b = torch.load(out / "ref_jagg_joint_0.pt"), torch.load(out / "ref_exact_batched_0.pt")
    va, vb = torch.cat([g.flatten() for g in a.values()]), torch.cat([g.flatten() for g in b.values()])
    cos = torch.nn.functional.cosine_similarity(va, vb, dim=0).item()
    assert 0 < cos < 1 - 1e-6


def cosine_worker(rank: int, out_dir: str) -> None:
    """group_gradient_cosines on the sharded model (dot products per shard + all-reduce) vs one process."""
    from jagg.engine.diagnostics import group_gradient_cosines
    from jagg.scale.distributed import shard_backbone

    rows = list(range(rank * B_GLOBAL // WORLD, (rank + 1) * B_GLOBAL // WORLD))
    ref, group = _problem()
    lat, sig, cond, loss = group(list(range(B_GLOBAL)))
    single = group_gradient_cosines(ref.bind(cond), lat, sig, loss, list(ref.parameters()), group_size=W)
    sharded, group = _problem()
    shard_backbone(sharded)
    lat, sig, cond, loss = group(rows)
    params = [p for p in sharded.parameters() if p.requires_grad]
    multi = group_gradient_cosines(sharded.bind(cond), lat, sig, loss, params, group_size=W)
    cosines = {"single": [c.cosine for c in single], "multi": [c.cosine for c in multi]}
    save_rank_result(out_dir, rank, cosines, name="cos")


def test_group_cosines_under_fsdp2_equal_one_process(tmp_path):
    """The automatic routing's measurement under FSDP2: no rank gathers a full gradient, same cosines."""
    out = run_ranks("test_distributed:cosine_worker", WORLD, tmp_path)
    for res in rank_results(out, WORLD, name="cos"):
        assert len(res["multi"]) == len(res["single"]) == 1  # one group of W = 4
        assert 0 < res["single"][0] < 1 - 1e-6
        assert res["multi"] == pytest.approx(res["single"], abs=1e-6)


def control_worker(rank: int, out_dir: str) -> None:
    """The positive control (train.control_cosine) on sharded gradients: the same exact gradient as one
    process, degraded with the direction drawn at full size and cut to each rank's shard; the dot products are
    local sums all-reduced (jagg.engine.control). The gathered result must equal one process's."""
    from helpers import Steps, one_group
    from jagg.common import SeedStream, generator
    from jagg.engine.control import degrade_gradients, random_direction
    from jagg.scale.distributed import full_grads, shard_backbone

    rows = list(range(rank * B_GLOBAL // WORLD, (rank + 1) * B_GLOBAL // WORLD))
    exact_backward = one_group("exact", W)
    ref, group = _problem()
    lat, sig, cond, loss = group(list(range(B_GLOBAL)))
    exact_backward.backward(ref.bind(cond), Steps(lat, sig, loss))
    exact = {n: p.grad.clone() for n, p in ref.named_parameters()}
    trained = [p for p in ref.parameters() if p.requires_grad]
    coef_ref = degrade_gradients(trained, random_direction(trained, generator(3, SeedStream.CONTROL)), 0.5)
    sharded, group = _problem()
    shard_backbone(sharded)
    lat, sig, cond, loss = group(rows)
    exact_backward.backward(sharded.bind(cond), Steps(lat, sig, loss))
    params = [p for p in sharded.parameters() if p.requires_grad]
    coef = degrade_gradients(params, random_direction(params, generator(3, SeedStream.CONTROL)), 0.5)
    grads = full_grads(sharded)
    flat = lambda d: torch.cat([d[n].double().flatten() for n in sorted(d)])  # noqa: E731
    g, g_ref, g0 = flat(grads), flat({n: p.grad for n, p in ref.named_parameters()}), flat(exact)
    save_rank_result(
        out_dir,
        rank,
        {
            "coef": list(coef),
            "coef_ref": list(coef_ref),
            "max_abs_diff": (g - g_ref).abs().max().item(),
            "max_abs_grad": g_ref.abs().max().item(),
            "cosine_to_exact": (torch.dot(g, g0) / (g.norm() * g0.norm())).item(),
            "norm_ratio": (g.norm() / g0.norm()).item(),
            "sharded": sum(hasattr(p, "device_mesh") for p in params),
        },
        name="control",
    )


def fidelity_worker(rank: int, out_dir: str) -> None:
    """log.fidelity_every's comparison (jagg.plugins.fidelity.compare_to_exact) on sharded gradients: a JAGG group
    against exact's shadow through all-reduced sums (no rank gathers a full gradient); one process's
    comparison of the full batch is the reference."""
    from helpers import Steps, one_group
    from jagg.plugins.fidelity import compare_to_exact
    from jagg.scale.distributed import shard_backbone

    rows = list(range(rank * B_GLOBAL // WORLD, (rank + 1) * B_GLOBAL // WORLD))
    out = {}
    for name, model_rows, shard in (("single", list(range(B_GLOBAL)), False), ("multi", rows, True)):
        model, group = _problem()
        if shard:
            shard_backbone(model)
        lat, sig, cond, loss = group(model_rows)
        steps = Steps(lat, sig, loss)
        one_group("jagg", W).backward(model.bind(cond), steps)
        params = [p for p in model.parameters() if p.requires_grad]
        exact = lambda: one_group("exact", W).backward(model.bind(cond), steps)  # noqa: E731
        out[name] = compare_to_exact(params, exact)
        out[name + "_sharded"] = sum(hasattr(p, "device_mesh") for p in params)
    save_rank_result(out_dir, rank, out, name="fidelity")


def test_fidelity_under_fsdp2_equals_one_process(tmp_path):
    out = run_ranks("test_distributed:fidelity_worker", WORLD, tmp_path)
    for res in rank_results(out, WORLD, name="fidelity"):
        assert res["multi_sharded"] > 0 and res["single_sharded"] == 0
        assert 0 < res["single"][0] < 1 - 1e-6  # W = 4: JAGG is not exact
        assert res["multi"] == pytest.approx(res["single"], abs=1e-5)


def test_positive_control_under_fsdp2_equals_one_process(tmp_path):
    out = run_ranks("test_distributed:control_worker", WORLD, tmp_path)
    for res in rank_results(out, WORLD, name="control"):
        assert res["sharded"] > 0  # the sharded path ran
        assert res["coef"] == pytest.approx(res["coef_ref"], rel=1e-4)
        assert res["max_abs_diff"] <= 1e-5 * res["max_abs_grad"]
        assert res["cosine_to_exact"] == pytest.approx(0.5, abs=1e-5)
        assert res["norm_ratio"] == pytest.approx(1.0, abs=1e-5)


def knots_worker(rank: int, out_dir: str) -> None:
    """Shared knots on the sharded model: K = 3 knots over the W = 4 steps in ONE block (one stacked forward,
    one backward), counted, and the gathered gradient against one process on the global batch."""
    from jagg.engine.knots import Knots
    from jagg.engine.strategies import interpolated_backward
    from jagg.scale.distributed import CollectiveCounter, fsdp_units, full_grads, shard_backbone

    rows = list(range(rank * B_GLOBAL // WORLD, (rank + 1) * B_GLOBAL // WORLD))
    knots = Knots(count=3, placement="index")
    ref, group = _problem()
    lat, sig, cond, loss = group(list(range(B_GLOBAL)))
    run = dict(graph_mode="batched", endpoint_signals="graph")
    interpolated_backward(ref.bind(cond), lat, sig, loss, knots.interpolation(sig), **run)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    sharded, group = _problem()
    shard_backbone(sharded)
    lat, sig, cond, loss = group(rows)
    velocity = sharded.bind(cond)
    outputs = _outputs(velocity, lat, sig)  # the rollout's, not counted
    with CollectiveCounter() as counts, count_post_backward() as post:
        stats = interpolated_backward(
            velocity, lat, sig, loss, knots.interpolation(sig), outputs=outputs, **run
        )
    grads = full_grads(sharded)
    save_rank_result(
        out_dir,
        rank,
        {
            "counts": dict(counts),
            "units": len(fsdp_units(sharded)),
            "post_backward": sorted(post.values()),
            "backward_passes": stats.backward_passes,
            "max_abs_diff": max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
            "max_abs_grad": max(g.abs().max().item() for g in ref_grads.values()),
        },
        name="knots",
    )


def test_knots_collectives_and_gradient_under_fsdp2(tmp_path):
    """One all-gather per unit in forward and one in backward, one reduce-scatter per unit for the micro-batch
    (exact: W of each), and the same gradient as one process."""
    out = run_ranks("test_distributed:knots_worker", WORLD, tmp_path)
    for res in rank_results(out, WORLD, name="knots"):
        units = res["units"]
        assert res["backward_passes"] == 3
        assert res["counts"]["all_gather_single"] == 2 * units
        assert res["counts"]["reduce_scatter_single"] == units
        assert res["post_backward"] == [1] * units
        assert res["max_abs_diff"] <= 1e-6 * max(1.0, res["max_abs_grad"])
