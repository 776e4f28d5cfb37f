"""``model.shard_frozen_base: false`` on 2 gloo ranks: a replicated frozen LoRA base gives the sharded-base
run's LoRA gradients, never all-gathers a base weight, and checkpoints / resumes the same way.

Both settings go through the trainer's own placement (``jagg.scale.placement.place_backbone``: LoRA, dtypes,
``shard_from_rank0``) on tiny Flux in float64. Rank 1's copy is scrambled before placement, so its frozen base
can only be right if rank 0 sent it in full. Each rank takes half of the global batch; FSDP2 averages the
gradients over the ranks, so both equal a one-process run on the global batch.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from dist_harness import rank_results, run_ranks, save_rank_result

B_GLOBAL, WORLD = 4, 2
SETTINGS = ("sharded", "replicated")  # model.shard_frozen_base = true / false


def _cfg(shard_frozen_base: bool, precision: str = "fp64", run_dir: str = "unused"):
    from jagg.config import load_config

    return load_config(
        None,
        [
            "model.source=tiny",
            "model.lora_rank=4",
            "model.lora_alpha=8",
            f"train.precision={precision}",
            f"model.shard_frozen_base={str(shard_frozen_base).lower()}",
            f"log.run_dir={run_dir}",
        ],
    )


def _placed(cfg, *, distributed: bool, scramble: bool = False):
    """Tiny Flux placed as the trainer places it; the adapters moved off their init (lora_B = 0 would leave
    every lora_A gradient zero), the same full values on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from jagg.distributed import DistInfo
    from jagg.models import build_tiny_backbone
    from jagg.scale.placement import place_backbone

    backbone = build_tiny_backbone("flux", seed=0)
    if scramble:  # what rank 0 does not send, this rank gets wrong
        with torch.no_grad():
            for p in backbone.parameters():
                p.uniform_(-1, 1)
    dist = DistInfo.current() if distributed else DistInfo()
    placed, _ = place_backbone(cfg, backbone, device=torch.device("cpu"), dist=dist)
    g = torch.Generator().manual_seed(7)
    dtype = torch.float64 if cfg.train.precision == "fp64" else torch.float32
    moved = {
        n: 0.05 * torch.randn(p.shape, generator=g, dtype=dtype)
        for n, p in placed.named_parameters()
        if p.requires_grad
    }
    with torch.no_grad():
        set_model_state_dict(placed, moved, options=StateDictOptions(full_state_dict=True, strict=False))
    return placed


def _loss(model, rows):
    from jagg.models import TextCond

    g = torch.Generator().manual_seed(0)
    z = torch.randn(B_GLOBAL, 16, 8, 8, generator=g, dtype=torch.float64)
    cond = TextCond(embeds=torch.randn(B_GLOBAL, 5, 32, generator=g, dtype=torch.float64))
    target = torch.randn(B_GLOBAL, 16, 8, 8, generator=g, dtype=torch.float64)
    v = model.velocity(z[rows], 0.7, cond.select(rows))
    return (v * target[rows]).flatten(1).sum(1).mean()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def frozen_base_worker(rank: int, out_dir: str) -> None:
    """One rank: both settings' gradients, collectives, frozen-base layout and a checkpoint round trip."""
    from jagg.distributed import DistInfo, is_sharded
    from jagg.ops.checkpoint import Progress, load_checkpoint, save_checkpoint
    from jagg.scale.distributed import CollectiveCounter, full_grads

    dist = DistInfo.current()
    rows = list(range(rank * B_GLOBAL // WORLD, (rank + 1) * B_GLOBAL // WORLD))
    result: dict = {}
    for setting in SETTINGS:
        run_dir = os.path.join(out_dir, setting)
        cfg = _cfg(setting == "sharded", run_dir=run_dir)
        model = _placed(cfg, distributed=True, scramble=rank > 0)
        sizes: Counter = Counter()
        with CollectiveCounter(sizes=sizes) as counts:
            _loss(model, rows).backward()
        grads = full_grads(model)
        frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        result[setting] = dict(
            counts=dict(counts),
            bytes=dict(sizes),
            frozen_sharded=sum(is_sharded(p) for p in frozen.values()),
            trained_sharded=sum(is_sharded(p) for p in trained.values()),
            n_frozen=len(frozen),
            n_trained=len(trained),
            frozen_bytes=sum(p.numel() * p.element_size() for p in frozen.values()),
            trained_bytes=sum(p.numel() * p.element_size() for p in trained.values()),
        )
        torch.save(grads, os.path.join(out_dir, f"grads_{setting}_{rank}.pt"))
        torch.save(
            {n: _full(p) for n, p in frozen.items()}, os.path.join(out_dir, f"frozen_{setting}_{rank}.pt")
        )
        # one AdamW step, a checkpoint, and a fresh replicated-base model resumed from it
        opt = torch.optim.AdamW(list(trained.values()), lr=1e-2)
        opt.step()
        progress = Progress(iteration=1, consecutive_skips=0, metrics=[], ema=None)
        path = save_checkpoint(run_dir, model=model, optimizer=opt, progress=progress, config={}, dist=dist)
        fresh = _placed(_cfg(False, run_dir=run_dir), distributed=True)
        fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
        load_checkpoint(path, model=fresh, optimizer=fresh_opt, ema=None, dist=dist)
        back = dict(fresh.named_parameters())
        result[setting]["resume_max_diff"] = max(
            (_full(back[n]) - _full(p)).abs().max().item() for n, p in trained.items()
        )
        moments = [
            (_full(a["exp_avg"]), _full(b["exp_avg"]))
            for a, b in zip(fresh_opt.state.values(), opt.state.values(), strict=True)
        ]
        result[setting]["resume_moment_max_diff"] = max((a - b).abs().max().item() for a, b in moments)
    # bf16 (the paper configs' precision): the replicated base is plain bf16, the adapters fp32 DTensors
    bf16 = _placed(_cfg(False, precision="bf16"), distributed=True)
    result["bf16"] = dict(
        frozen=sorted({f"{type(p).__name__}/{p.dtype}" for p in bf16.parameters() if not p.requires_grad}),
        trained=sorted({f"{type(p).__name__}/{p.dtype}" for p in bf16.parameters() if p.requires_grad}),
    )
    save_rank_result(out_dir, rank, result)


@pytest.fixture(scope="module")
def frozen_results(tmp_path_factory):
    out = run_ranks("test_frozen_base:frozen_base_worker", WORLD, tmp_path_factory.mktemp("frozen"))
    return rank_results(out, WORLD), out


def test_replicated_base_lora_gradients_equal_sharded_and_one_process(frozen_results):
    """Every LoRA gradient, gathered, equals the sharded-base run's and a one-process run's (float64)."""
    _, out = frozen_results
    ref_model = _placed(_cfg(True), distributed=False)
    _loss(ref_model, list(range(B_GLOBAL))).backward()
    ref = {n: p.grad for n, p in ref_model.named_parameters() if p.requires_grad}
    assert ref and all("lora_" in n for n in ref)
    for rank in range(WORLD):
        sharded = torch.load(out / f"grads_sharded_{rank}.pt")
        replicated = torch.load(out / f"grads_replicated_{rank}.pt")
        assert set(replicated) == set(sharded) == {n for n, g in ref.items() if g is not None}
        scale = max(g.abs().max().item() for g in sharded.values())
        assert scale > 1e-3  # non-trivial gradients, lora_A included
        assert all(sharded[n].abs().max() > 0 for n in sharded if "lora_A" in n and "single" not in n)
        for n, g in replicated.items():
            torch.testing.assert_close(g, sharded[n], rtol=1e-10, atol=1e-12 * scale)
            torch.testing.assert_close(g, ref[n], rtol=1e-10, atol=1e-12 * scale)


def test_replicated_base_is_rank0s_and_not_a_dtensor(frozen_results):
    """The frozen base stays plain tensors (no DTensor) on every rank, equal to rank 0's weights (rank 1's own
    copy was scrambled: it was broadcast in full); only the adapters are sharded."""
    results, out = frozen_results
    expected = torch.load(out / "frozen_sharded_0.pt")
    for rank, res in enumerate(results):
        rep, sh = res["replicated"], res["sharded"]
        assert rep["frozen_sharded"] == 0 and rep["trained_sharded"] == rep["n_trained"] > 0
        assert sh["frozen_sharded"] == sh["n_frozen"] > 0
        got = torch.load(out / f"frozen_replicated_{rank}.pt")
        assert set(got) == set(expected)
        assert all(torch.equal(got[n], expected[n]) for n in expected)
        assert res["bf16"] == {"frozen": ["Parameter/torch.bfloat16"], "trained": ["DTensor/torch.float32"]}


def test_replicated_base_all_gathers_only_the_adapters(frozen_results):
    """Per update (one forward + backward): the sharded base all-gathers every weight (forward, and again in
    backward); the replicated one only the adapters, with fewer calls (the root unit, no adapters, gathers
    nothing) and the same gradient reduction of the adapters."""
    results, _ = frozen_results
    for res in results:
        rep, sh = res["replicated"], res["sharded"]
        units = 4  # tiny Flux: 2 double + 2 single-stream blocks (with adapters), + the root (none)
        # every weight gathered twice (forward, backward re-gather; tiny shapes need no padding to 2 ranks)
        assert sh["bytes"]["all_gather_single"] == 2 * (sh["frozen_bytes"] + sh["trained_bytes"])
        assert rep["bytes"]["all_gather_single"] == 2 * rep["trained_bytes"]  # the adapters only
        assert sh["counts"]["all_gather_single"] == 2 * (units + 1)
        assert rep["counts"]["all_gather_single"] == 2 * units
        assert "all_reduce" not in rep["counts"] and "all_reduce" not in sh["counts"]
        assert rep["counts"]["reduce_scatter_single"] == sh["counts"]["reduce_scatter_single"] == units
        assert rep["bytes"]["reduce_scatter_single"] == sh["bytes"]["reduce_scatter_single"]


def test_checkpoint_resumes_into_a_replicated_base(frozen_results):
    """Only the adapters are saved; either setting's checkpoint resumes a replicated-base model exactly."""
    results, out = frozen_results
    from jagg.ops.checkpoint import read_checkpoint

    for res in results:
        for setting in SETTINGS:
            assert res[setting]["resume_max_diff"] == 0.0
            assert res[setting]["resume_moment_max_diff"] == 0.0
    saved = read_checkpoint(out / "replicated" / "checkpoint")
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)


def test_shard_frozen_base_needs_lora():
    from jagg.errors import ConfigError

    with pytest.raises(ConfigError, match="model.shard_frozen_base"):
        from jagg.config import load_config

        load_config(None, ["model.shard_frozen_base=false"])
    assert not _cfg(False).model.shard_frozen_base
