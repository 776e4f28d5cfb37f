"""Every paper config (configs/paper/*.yaml, both backbones; SD3.5-M's, in configs/paper/sd3/, in test_sd3.py)
through the CLI on 2 gloo ranks, as a new user runs it, on the tiny random-init pipelines of the real classes that ``tests/test_pretrained_pipeline.py`` builds.

One ``dist_harness.run_ranks`` job (one process start per rank) calls ``jagg.train.main`` once per config with
the config's own precision (bf16 autocast over fp32 master weights), gradient checkpointing, LoRA or full
fine-tuning and embedding precompute; only sizes shrink (one iteration, 8x8 latents, 2 samples). Rank 1 builds
the transformer on the meta device and receives its shards from rank 0 (``shard_from_rank0``): before the fix,
Qwen-Image's rotary tables (plain tensor attributes) stayed on the meta device there and the first forward
failed with ``Cannot copy out of meta tensor``. ``main``'s final process-group teardown is left to the harness.
Last, rank 1's checkpoint shard of one run is truncated and ``--resume`` must end on both ranks with exit 2 and
one error line (rank 0's) naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks
from helpers import paper_tiny_argv

WORLD = 2
CONFIGS = sorted(p.stem for p in Path("configs/paper").glob("*.yaml") if p.stem != "base")


def _argv(out: Path, name: str) -> list[str]:
    # the authors' recipe trains whole blocks of W = 4: 8 usable steps = 2 blocks, 1 of them trained
    authors = ["sampling.num_steps=9"] if name.endswith("_authors") else []
    return paper_tiny_argv(
        f"configs/paper/{name}.yaml",
        out / name.split("_")[0],
        out / "prompts.txt",
        out / "runs" / name,
        f"data.embedding_cache={out / 'emb' / name}",
        *authors,
        # every step trained: 3 of 4 steps, interpolated through 2 knots (4 would make every step a knot)
        *(["backward.knots=2"] if name.endswith("_knots") else []),
    )


def paper_worker(rank: int, out_dir: str) -> None:
    """One rank: the CLI's ``main`` for every paper config (the harness owns the process group)."""
    import jagg.train

    jagg.train._shutdown = lambda: None  # the harness destroys the process group after the last config
    import torch.distributed as dist

    out = Path(out_dir)
    codes = {}
    for name in CONFIGS:
        codes[name] = jagg.train.main(_argv(out, name))
    # issue 19's second failure: rank 1's shard truncated (`truncate -s 1000`), then --resume on both ranks
    shard = out / "runs" / CONFIGS[0] / "checkpoint" / "__1_0.distcp"
    if rank == 0:
        with open(shard, "r+b") as f:
            f.truncate(1000)
    dist.barrier()
    try:
        jagg.train.main(["--resume", *_argv(out, CONFIGS[0]), "train.iterations=2"])
    except SystemExit as exc:
        codes["resume_truncated"] = exc.code
    (out / f"codes_rank{rank}.json").write_text(json.dumps(codes))


@pytest.fixture(scope="module")
def paper_runs(tmp_path_factory):
    from test_pretrained_pipeline import PROMPTS, save_flux_pipeline, save_qwenimage_pipeline

    out = tmp_path_factory.mktemp("paper_two_ranks")
    save_flux_pipeline(out / "flux")
    save_qwenimage_pipeline(out / "qwenimage")
    (out / "prompts.txt").write_text("\n".join(PROMPTS[:2]) + "\n")
    run_ranks("test_paper_configs_two_ranks:paper_worker", WORLD, out)
    return out


def test_truncated_shard_on_resume_is_one_line_exit_2(paper_runs):
    shard = paper_runs / "runs" / CONFIGS[0] / "checkpoint" / "__1_0.distcp"
    for r in range(WORLD):
        assert json.loads((paper_runs / f"codes_rank{r}.json").read_text())["resume_truncated"] == 2
    errors = [
        line
        for r in range(WORLD)
        for line in (paper_runs / f"rank{r}.log").read_text().splitlines()
        if line.startswith("error:")
    ]
    assert len(errors) == 1 and str(shard) in errors[0] and "truncated or corrupt (1000 bytes" in errors[0]


def test_meta_built_qwenimage_gets_the_rotary_tables_of_a_real_build():
    """What ``shard_from_rank0`` does on ranks > 0: the meta-built transformer's plain tensor attributes are
    recomputed, equal to those of a transformer built on the CPU."""
    from jagg.models import build_tiny_backbone
    from jagg.scale.distributed import materialize_tensor_attributes

    real = build_tiny_backbone("qwenimage").transformer
    with torch.device("meta"):
        meta = type(real).from_config(real.config)
    meta.to_empty(device="cpu")
    assert meta.pos_embed.pos_freqs.is_meta
    assert materialize_tensor_attributes(meta, "cpu") == 2  # pos_freqs, neg_freqs
    for attr in ("pos_freqs", "neg_freqs"):
        assert torch.equal(getattr(meta.pos_embed, attr), getattr(real.pos_embed, attr))
    assert materialize_tensor_attributes(meta, "cpu") == 0


def test_every_paper_config_is_found():
    """The four recipes of the paper, MixGRPO, every step trained through knots and the JAGG authors' Qwen-Image
    recipe, both backbones."""
    assert CONFIGS == [
        "flux_dancegrpo",
        "flux_dancegrpo_knots",
        "flux_flowgrpo_fast",
        "flux_mixgrpo",
        "qwenimage_dancegrpo",
        "qwenimage_dancegrpo_authors",
        "qwenimage_dancegrpo_knots",
        "qwenimage_flowgrpo_fast",
        "qwenimage_mixgrpo",
    ]


@pytest.mark.parametrize("name", CONFIGS)
def test_paper_config_trains_on_two_ranks(paper_runs, name):
    for r in range(WORLD):
        assert json.loads((paper_runs / f"codes_rank{r}.json").read_text())[name] == 0
    run = paper_runs / "runs" / name
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]  # evaluation first, then the one iteration (+ its eval)
    last = rows[-1]
    assert last["skipped_steps"] == 0 and last["optimizer_steps"] == 1
    assert torch.isfinite(torch.tensor([last["loss"], last["grad_norm"], last["eval_jpeg_mean"]])).all()
    assert json.loads((run / "run.json").read_text())["world_size"] == WORLD
    assert sorted(p.name for p in (run / "checkpoint").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
