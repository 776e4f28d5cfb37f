"""Sharded checkpoints, loading from rank 0 and export under FSDP2, on 2 gloo ranks (CPU).

One 2-rank run (``dist_harness.run_ranks``) of a ``model.source=pretrained`` Flux DanceGRPO config, full
fine-tuning with EMA, whose transformer (~60M parameters, big enough for memory to show) is a random-init
``FluxTransformer2DModel`` saved with ``save_pretrained`` into a tiny pipeline folder (``model.path``):

* loading: rank 1 builds the transformer on the meta device and receives its shards from rank 0; every rank's
  shards equal the slices of the saved safetensors file (read with ``safe_open``, only the rank's rows);
* resume: 2 iterations uninterrupted == 1 iteration + checkpoint (each rank writes its own ``.distcp``) +
  a fresh trainer that loads it and runs 1 more: identical metrics, weights, EMA and Adam state;
* export: rank 0 writes a diffusers transformer folder (the EMA weights); ``--export``'s path from the
  checkpoint alone (``export_run``), on the 2 ranks and on one process, writes the same tensors;
  ``from_pretrained`` of it gives the trained model.

* LoRA under bf16 (tiny world model): frozen base bf16, adapters fp32 in the same FSDP2 units; the
  checkpoint holds the adapters only.

Peak host memory per phase of both ranks (VmHWM, reset per phase through ``/proc/self/clear_refs``, and the
process's ``ru_maxrss``) goes to ``report_rank{r}.json`` and is printed by ``test_rank1_peak_host_memory``.
"""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch

from dist_harness import rank_results, run_ranks, save_rank_result
from jagg.ops.checkpoint import read_checkpoint

WORLD = 2


class RandomReward:
    """Deterministic in the images: a fixed random projection of the pixels (no ties, unlike JPEG sizes)."""

    def __call__(self, images, prompts):
        g = torch.Generator().manual_seed(0)
        w = torch.randn(images[0].numel(), generator=g)
        return images.flatten(1).float() @ w / images[0].numel() ** 0.5


def _cfg(out: Path, run: str, *overrides):
    from jagg.config import load_config

    pipe = out / "pipeline"
    return load_config(
        "configs/paper/flux_dancegrpo.yaml",
        [
            f"model.path={pipe}",
            "model.max_sequence_length=16",
            "model.gradient_checkpointing=false",
            "sampling.latent_size=8",
            "sampling.num_steps=4",
            "sampling.eval_num_steps=3",
            "algorithm.clip_range=0.2",
            "train.device=cpu",
            "train.precision=fp32",
            "train.iterations=2",
            "train.prompts_per_iter=1",
            "train.images_per_prompt=4",  # one group of 4 over 2 ranks: 2 samples = 1 micro-batch per rank
            "train.train_batch_size=2",
            "train.grad_accum=1",
            "optim.lr=1e-4",
            "optim.ema_decay=0.5",
            "reward.weights={random_test: 1.0}",
            "reward.eval=[]",
            "reward.kwargs={}",
            f"data.train_prompts={pipe / 'prompts.txt'}",
            f"data.eval_prompts={pipe / 'prompts.txt'}",
            "data.eval_limit=null",
            "log.eval_every=0",
            "log.checkpoint_every=0",
            f"log.run_dir={out / run}",
            *overrides,
        ],
    )


# --------------------------------------------------------------------------- memory probes (Linux)
def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB
    return float("nan")


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the next reading is the peak of one phase."""
    Path("/proc/self/clear_refs").write_text("5")


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


class Memory:
    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = {}

    def start(self) -> None:
        self._before = _status_mb("VmRSS")
        _reset_peak()

    def stop(self, phase: str) -> None:
        self.rows[phase] = {
            "rss_before_mb": round(self._before, 1),
            "peak_mb": round(_status_mb("VmHWM"), 1),
            "rss_after_mb": round(_status_mb("VmRSS"), 1),
        }


# --------------------------------------------------------------------------- the ranks
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _rows(rank: int, t: torch.Tensor) -> slice:
    """This rank's rows of a dim-0 FSDP2 shard (torch.chunk layout: ceil(n / world) rows per rank)."""
    per = -(-t.shape[0] // WORLD)
    return slice(rank * per, rank * per + _local(t).shape[0])


def _matches_file(rank: int, tensors: dict[str, torch.Tensor], file: Path, prefix: str = "") -> list[str]:
    """Names whose local shard differs from its rows in the safetensors ``file`` (read lazily, rows only)."""
    from safetensors import safe_open

    bad = []
    with safe_open(str(file), framework="pt") as f:
        for name, t in tensors.items():
            local = _local(t.detach())
            key = name.removeprefix(prefix)
            saved = f.get_slice(key)[_rows(rank, t)] if local.ndim else f.get_tensor(key)
            if not torch.equal(local, saved.to(local.dtype)):
                bad.append(name)
    return bad


def _snapshot(trainer) -> dict:
    """This rank's shards of the weights, EMA and Adam state (clones) and the metrics rows."""
    state = trainer.optimizer.state
    return {
        "params": [_local(p.detach()).clone() for p in trainer.params],
        "ema": [_local(e).clone() for e in trainer.ema],
        "adam": [
            {k: _local(v).clone() for k, v in state[p].items() if torch.is_tensor(v)} for p in trainer.params
        ],
        "metrics": [
            {k: v for k, v in m.items() if not k.startswith(("time_", "peak_memory"))}
            for m in trainer.metrics
        ],
    }


def checkpoint_worker(rank: int, out_dir: str) -> None:
    """One rank (``dist_harness.run_ranks`` owns the process group)."""
    import gc

    from jagg.distributed import DistInfo
    from jagg.loop.components import build_components
    from jagg.loop.export import export_run, export_trained
    from jagg.loop.trainer import Trainer
    from jagg.ops.checkpoint import find_checkpoint
    from jagg.rewards import REWARDS
    from jagg.scale.placement import place_backbone

    REWARDS["random_test"] = lambda device=None: RandomReward()
    out = Path(out_dir)
    mem = Memory()
    mem.rows["after_imports"] = {"rss_mb": round(_status_mb("VmRSS"), 1)}
    report: dict = {}

    # 1. load: rank 0 reads the weights, rank 1 builds on meta and receives its shards
    cfg = _cfg(out, "full")
    mem.start()
    comp = build_components(cfg)
    mem.stop("build components (transformer on meta off rank 0)")
    report["meta"] = next(comp.backbone.parameters()).is_meta
    mem.start()
    backbone, _ = place_backbone(cfg, comp.backbone, device=torch.device("cpu"), dist=DistInfo.current())
    mem.stop("shard from rank 0")
    named = dict(backbone.transformer.named_parameters())
    report["load_mismatch"] = _matches_file(
        rank, named, out / "pipeline" / "transformer" / "diffusion_pytorch_model.safetensors"
    )
    report["n_params"] = sum(p.numel() for p in named.values())
    del comp, backbone, named
    gc.collect()

    # 2. uninterrupted: 2 iterations
    full = Trainer(cfg, build_components(cfg), cfg.log.run_dir)
    full.fit()
    ref = _snapshot(full)
    del full
    gc.collect()

    # 3. 1 iteration + checkpoint, then a fresh trainer resumes for 1 more
    cut_cfg = _cfg(out, "cut", "train.iterations=1")
    cut = Trainer(cut_cfg, build_components(cut_cfg), cut_cfg.log.run_dir)
    cut.fit()  # ends with a checkpoint
    mem.start()
    cut.save_checkpoint()  # the same save again, measured on its own
    mem.stop("save checkpoint (sharded)")
    del cut
    gc.collect()
    cfg2 = _cfg(out, "cut")
    resumed = Trainer(cfg2, build_components(cfg2), cfg2.log.run_dir)
    mem.start()
    resumed.load_checkpoint()
    mem.stop("load checkpoint (sharded)")
    report["resumed_at"] = resumed.iteration
    resumed.fit()
    got = _snapshot(resumed)
    report["metrics_equal"] = got["metrics"] == ref["metrics"]
    report["metrics"] = got["metrics"]
    report["params_equal"] = all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"], strict=True))
    report["ema_equal"] = all(torch.equal(a, b) for a, b in zip(got["ema"], ref["ema"], strict=True))
    report["adam_equal"] = all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(got["adam"], ref["adam"], strict=True)
    )
    report["shard_files"] = sorted(p.name for p in find_checkpoint(cfg2.log.run_dir).glob("*.distcp"))

    # 4. export: the live run, then the checkpoint alone (what --export does); both hold the EMA weights
    mem.start()
    export_trained(cfg2, resumed.backbone, out / "export", dist=resumed.dist, ema=resumed.ema)
    mem.stop("export (gather to rank 0, rank 0 writes)")
    ema = dict(zip([n for n, p in resumed.backbone.named_parameters() if p.requires_grad], resumed.ema))
    report["export_mismatch"] = _matches_file(
        rank, ema, out / "export" / "diffusion_pytorch_model.safetensors", prefix="transformer."
    )
    del resumed
    gc.collect()
    export_run(cfg2, out / "export_from_checkpoint")

    mem.rows["ru_maxrss_mb (process peak)"] = {"peak_mb": round(_maxrss_mb(), 1)}

    # 5. LoRA under bf16: the frozen base stays bf16 next to fp32 adapters in one FSDP2 unit (mixed dtypes)
    from jagg.config import TINY_OVERRIDES, load_config

    lora_cfg = load_config(
        "configs/world/flux_flowgrpo_fast.yaml",
        [
            *TINY_OVERRIDES,
            "train.iterations=1",
            "train.prompts_per_iter=1",
            "train.images_per_prompt=4",
            "train.train_batch_size=2",
            "sampling.num_steps=4",
            "algorithm.sde_window_range=[0, 4]",
            "log.eval_every=0",
            "train.precision=bf16",
            "model.lora_rank=4",
            "model.lora_alpha=8",
            f"log.run_dir={out / 'lora'}",
        ],
    )
    lora = Trainer(lora_cfg, build_components(lora_cfg), lora_cfg.log.run_dir)
    report["lora_dtypes"] = sorted({f"{p.dtype} {p.requires_grad}" for p in lora.backbone.parameters()})
    report["lora_row"] = {k: lora.fit()[0][k] for k in ("loss", "grad_norm", "onpolicy_ratio_max_dev")}
    report["memory"] = mem.rows
    save_rank_result(out, rank, report, name="report_rank")


# --------------------------------------------------------------------------- the test process
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from diffusers import FluxTransformer2DModel

    from jagg.scale.tiny_pipeline import MEDIUM_FLUX
    from test_pretrained_pipeline import PROMPTS, save_flux_pipeline

    out = tmp_path_factory.mktemp("dist_ckpt")
    pipe = out / "pipeline"
    save_flux_pipeline(pipe)
    torch.manual_seed(3)
    FluxTransformer2DModel(**MEDIUM_FLUX).save_pretrained(pipe / "transformer")  # replaces the tiny one
    (pipe / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    run_ranks("test_distributed_checkpoint:checkpoint_worker", WORLD, out)
    return out, rank_results(out, WORLD, name="report_rank")


def test_loading_from_rank0_gives_every_rank_its_shards(two_ranks):
    _, reports = two_ranks
    assert 50e6 < reports[0]["n_params"] < 70e6
    assert [r["meta"] for r in reports] == [False, True]  # only rank 0 read the weights
    for r in reports:
        assert r["load_mismatch"] == []


def test_resume_on_two_ranks_equals_the_uninterrupted_run(two_ranks):
    _, reports = two_ranks
    for r in reports:
        assert r["shard_files"] == ["__0_0.distcp", "__1_0.distcp"]
        assert r["resumed_at"] == 1
        assert [m["iteration"] for m in r["metrics"]] == [1, 2]
        assert all(m["optimizer_steps"] == 1 and m["grad_norm"] > 0 for m in r["metrics"])
        assert r["metrics_equal"] and r["params_equal"] and r["ema_equal"] and r["adam_equal"]


def test_export_writes_the_ema_weights_once(two_ranks):
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    out, reports = two_ranks
    for r in reports:
        assert r["export_mismatch"] == []
    live = load_file(out / "export" / "diffusion_pytorch_model.safetensors")
    again = load_file(out / "export_from_checkpoint" / "diffusion_pytorch_model.safetensors")
    assert live.keys() == again.keys() and all(torch.equal(live[k], again[k]) for k in live)
    model = FluxTransformer2DModel.from_pretrained(out / "export")
    assert all(torch.equal(p, live[n]) for n, p in model.named_parameters())
    assert not (out / "export.tmp").exists()
    # the 2-rank checkpoint exported by one process (DCP reshards): the same tensors
    from jagg.loop.export import export_run

    export_run(_cfg(out, "cut"), out / "export_one_process")
    one = load_file(out / "export_one_process" / "diffusion_pytorch_model.safetensors")
    assert one.keys() == live.keys() and all(torch.equal(live[k], one[k]) for k in live)


def test_lora_bf16_under_fsdp2_keeps_the_frozen_base_in_bf16(two_ranks):
    out, reports = two_ranks
    for r in reports:
        assert r["lora_dtypes"] == ["torch.bfloat16 False", "torch.float32 True"]
        assert r["lora_row"] == reports[0]["lora_row"] and r["lora_row"]["grad_norm"] > 0
    ckpt = read_checkpoint(out / "lora" / "checkpoint")  # written sharded by 2 ranks, read by one process
    assert ckpt and all("lora_" in k for k in ckpt if k.startswith("model."))


def test_rank1_peak_host_memory(two_ranks, capsys):
    """Recorded and printed per phase; bounded: rank 1 never holds the full model (fp32: 243 MB), only its
    shards (half) plus one tensor in transit, and checkpoints move shards only."""
    _, reports = two_ranks
    full_mb = reports[1]["n_params"] * 4 / 2**20
    with capsys.disabled():
        print(
            f"\nhost memory per phase ({reports[1]['n_params'] / 1e6:.1f}M-parameter transformer, fp32 "
            f"{full_mb:.0f} MB in full; MB)"
        )
        for r, rep in enumerate(reports):
            for phase, row in rep["memory"].items():
                print(f"  rank {r}  {phase:<46} {row}")
    mem = reports[1]["memory"]
    build, place = mem["build components (transformer on meta off rank 0)"], mem["shard from rank 0"]
    assert build["peak_mb"] - build["rss_before_mb"] < 0.5 * full_mb  # no transformer weights read
    assert place["peak_mb"] - place["rss_before_mb"] < 0.75 * full_mb  # its shards (0.5) + one tensor
    save, load = mem["save checkpoint (sharded)"], mem["load checkpoint (sharded)"]
    assert save["peak_mb"] - save["rss_before_mb"] < 0.5 * full_mb  # writes straight from the shards
    # loading allocates the fresh optimizer's AdamW moments of this rank's shards (2 x 0.5 x full) and gathers
    # nothing (the former single-file format read the full weights and both moments, 3 x full, on every rank)
    assert load["peak_mb"] - load["rss_before_mb"] < 1.25 * full_mb
