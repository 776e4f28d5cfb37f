"""Asynchronous checkpoints (``log.async_checkpoint``, ``jagg.ops.checkpoint.CheckpointWriter``) on tiny
random-init world backbones: the checkpoints an asynchronous run writes equal a synchronous run's; a save is
a snapshot of the state when it started and is invisible until finished, while training goes on; the same on 2
gloo ranks (FSDP2), resume included. The kill -9 drill with a write in flight is in ``test_run_safety``."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_harness import rank_results, run_ranks, save_rank_result
from helpers import build_trainer, tiny_config
from jagg.distributed import DistInfo
from jagg.ops.checkpoint import (
    checkpoint_candidates,
    read_checkpoint,
    read_progress,
    trainable_names,
    verify_checkpoint,
)

TIME_KEYS = ("time_", "peak_memory")
RUN = ("train.iterations=3", "log.checkpoint_every=1", "log.keep_checkpoints=2", "optim.ema_decay=0.5")


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows]


def _same_checkpoints(a: Path, b: Path) -> None:
    """``a`` and ``b`` verify and hold the same tensors, iteration, metrics (timings aside) and RNG states."""
    for path in (a, b):
        verify_checkpoint(path, DistInfo())
    ta, tb = read_checkpoint(a), read_checkpoint(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    pa, pb = read_progress(a), read_progress(b)
    for key in ("iteration", "consecutive_skips", "optimizer_saved", "world_size"):
        assert pa[key] == pb[key], key
    assert _strip(pa["metrics"]) == _strip(pb["metrics"])
    assert torch.equal(pa["rng"]["torch"], pb["rng"]["torch"]) and pa["rng"]["python"] == pb["rng"]["python"]
    assert np.array_equal(pa["rng"]["numpy"][1], pb["rng"]["numpy"][1])


def test_an_async_run_writes_the_checkpoints_a_sync_run_writes(tmp_path):
    trainers = {
        a: build_trainer(tiny_config(tmp_path / a, *RUN, f"log.async_checkpoint={a}"))
        for a in ("false", "true")
    }
    assert [t.checkpoints.asynchronous for t in trainers.values()] == [False, True]
    rows = {a: _strip(t.fit()) for a, t in trainers.items()}
    assert rows["true"] == rows["false"] and [r["iteration"] for r in rows["true"]] == [1, 2, 3]
    run = tmp_path / "true"
    assert sorted(p.name for p in run.glob("checkpoint*")) == ["checkpoint", "checkpoint.prev"]  # keep 2
    assert read_progress(run / "checkpoint.prev")["iteration"] == 2
    for name in ("checkpoint", "checkpoint.prev"):
        _same_checkpoints(tmp_path / "false" / name, run / name)


def test_auto_is_asynchronous_on_cuda_only(tmp_path):
    from jagg.config import LogConfig

    assert [LogConfig().writes_async(d) for d in ("cuda", "cpu")] == [True, False]
    assert LogConfig(async_checkpoint=False).writes_async("cuda") is False
    assert LogConfig(async_checkpoint=True).writes_async("cpu") is True
    cfg = tiny_config(tmp_path, "log.async_checkpoint=auto")
    assert cfg.log.async_checkpoint is None and cfg.to_dict()["log"]["async_checkpoint"] == "auto"
    assert build_trainer(cfg).checkpoints.asynchronous is False  # train.device=cpu


@pytest.fixture
def gated_writes(monkeypatch):
    """DCP's shard writes wait until the returned event is set (the save stays in flight meanwhile)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    gate, real = threading.Event(), FileSystemWriter.write_data

    def gated(self, plan, planner):
        assert gate.wait(timeout=600)
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", gated)
    yield gate
    gate.set()


def _live_state(trainer) -> dict:
    """Copies of what a checkpoint holds, keyed as ``read_checkpoint`` keys them, plus metrics and RNG."""
    names, state = trainable_names(trainer.backbone), {}
    for name, p, e in zip(names, trainer.params, trainer.ema, strict=True):
        state[f"model.{name}"], state[f"ema.{name}"] = p.detach().clone(), e.clone()
        for k in ("exp_avg", "exp_avg_sq"):
            state[f"optimizer.state.{name}.{k}"] = trainer.optimizer.state[p][k].clone()
    return {"tensors": state, "metrics": copy.deepcopy(trainer.metrics), "rng": torch.get_rng_state()}


def test_an_async_save_is_a_snapshot_invisible_until_finished(tmp_path, gated_writes):
    over = (
        "train.iterations=2",
        "log.checkpoint_every=0",
        "optim.ema_decay=0.5",
        "log.async_checkpoint=true",
    )
    trainer = build_trainer(tiny_config(tmp_path, *over))
    trainer._next_iteration(None)
    at_save = _live_state(trainer)
    trainer.save_checkpoint()  # returns with the shards' write waiting at the gate
    assert checkpoint_candidates(tmp_path) == [] and (tmp_path / "checkpoint.tmp").is_dir()
    trainer._next_iteration(None)  # training goes on: weights, EMA, Adam moments and metrics move
    torch.rand(3)  # and the global RNG (the loop draws from its own generators; a library may not)
    later = _live_state(trainer)
    assert checkpoint_candidates(tmp_path) == [] and trainer.iteration == 2
    gated_writes.set()
    assert trainer.checkpoints.finish() == tmp_path / "checkpoint"
    assert not (tmp_path / "checkpoint.tmp").exists()
    verify_checkpoint(tmp_path / "checkpoint", DistInfo())
    saved, progress = read_checkpoint(tmp_path / "checkpoint"), read_progress(tmp_path / "checkpoint")
    assert at_save["tensors"].keys() <= saved.keys()
    for key, value in at_save["tensors"].items():
        assert torch.equal(saved[key], value), key
    assert any(not torch.equal(later["tensors"][k], v) for k, v in at_save["tensors"].items())
    assert progress["iteration"] == 1 and progress["metrics"] == at_save["metrics"] != later["metrics"]
    assert torch.equal(progress["rng"]["torch"], at_save["rng"]) and not torch.equal(
        at_save["rng"], later["rng"]
    )


def test_a_save_becomes_the_checkpoint_at_the_first_poll_after_its_write(tmp_path, gated_writes):
    """``CheckpointWriter.poll`` (the CLI calls it after every iteration) leaves a save in flight alone while
    its write goes on, however many boundaries pass, and finishes it at the first poll once the write is done;
    before the change the save became the checkpoint only at the next save or the end of ``fit``."""
    from concurrent.futures import wait

    over = ("train.iterations=3", "log.checkpoint_every=0", "log.async_checkpoint=true")
    trainer = build_trainer(tiny_config(tmp_path, *over))
    writer = trainer.checkpoints
    assert writer.poll() is None  # nothing in flight: nothing to do
    trainer._next_iteration(None)
    trainer.save_checkpoint()  # its shards wait at the gate
    polls = []
    for _ in range(2):  # two boundaries pass while the write is held up
        polls.append(writer.poll())
        assert checkpoint_candidates(tmp_path) == [] and writer.pending is not None
        trainer._next_iteration(None)
    gated_writes.set()
    wait([writer.pending.written])  # the write is done (digests included): the next boundary finishes it
    polls.append(writer.poll())
    assert polls == [None, None, tmp_path / "checkpoint"] and writer.pending is None
    assert not (tmp_path / "checkpoint.tmp").exists()
    verify_checkpoint(tmp_path / "checkpoint", DistInfo())
    assert read_progress(tmp_path / "checkpoint")["iteration"] == 1 and trainer.iteration == 3
    assert writer.poll() is None and writer.finish() is None  # finished once


def test_a_synchronous_writer_has_nothing_to_poll(tmp_path):
    trainer = build_trainer(tiny_config(tmp_path, "log.async_checkpoint=false", "log.checkpoint_every=0"))
    trainer._next_iteration(None)
    trainer.save_checkpoint()
    assert trainer.checkpoints.pending is None and trainer.checkpoints.poll() is None
    assert read_progress(tmp_path / "checkpoint")["iteration"] == 1


FAILED_WRITES = {  # errno -> what the one-line error says after the checkpoint and the file
    "ENOSPC": r"No space left on device \(ENOSPC\); .* free on .*, .* needed; free some space",
    "EFBIG": r"File too large \(EFBIG\)(: the file-size limit .*)?; the previous checkpoint stays",
}


@pytest.mark.parametrize("code", sorted(FAILED_WRITES))
@pytest.mark.parametrize("asynchronous", ["false", "true"])
def test_a_failed_write_is_one_error_naming_the_file_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, asynchronous, code
):
    """ENOSPC or EFBIG inside DCP's writer reaches the caller as DCP's CheckpointException (a BaseException
    wrapping each rank's error): one CheckpointError naming the shard and the errno, from the save itself or,
    asynchronous, from the poll after the next iteration."""
    import errno
    import os

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from jagg.errors import CheckpointError

    calls, real = [], FileSystemWriter.write_data

    def second_fails(self, plan, planner):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", second_fails)
    over = ("train.iterations=3", "log.checkpoint_every=1", f"log.async_checkpoint={asynchronous}")
    trainer = build_trainer(tiny_config(tmp_path, *over))
    trainer._next_iteration(None)
    if asynchronous == "true":
        trainer.checkpoints.pending.written.result()  # the first save's write is done: the poll finishes it
        assert trainer.checkpoints.poll() == tmp_path / "checkpoint"
    prefix = "disk full while writing" if code == "ENOSPC" else "writing"
    shard = tmp_path / "checkpoint.tmp" / "__0_0.distcp"
    pattern = f"{prefix} checkpoint {tmp_path / 'checkpoint'}( failed)?: {shard}: {FAILED_WRITES[code]}"
    with pytest.raises(CheckpointError, match=pattern):
        trainer._next_iteration(None)  # the second save fails (asynchronous: in the background)
        assert asynchronous == "true" and trainer.checkpoints.pending is not None
        trainer.checkpoints.pending.written.exception()  # wait for the background write to fail
        trainer.checkpoints.poll()  # the CLI's poll after the next iteration reports it
    assert not (tmp_path / "checkpoint.tmp").exists()
    assert read_progress(tmp_path / "checkpoint")["iteration"] == 1
    verify_checkpoint(tmp_path / "checkpoint", DistInfo())


def test_a_write_error_without_an_errno_at_the_file_size_limit_is_efbig(tmp_path, monkeypatch):
    """torch's zip writer may report a write past the file-size limit as a RuntimeError without the OSError:
    the file that reached the limit (ulimit -f) is named as EFBIG all the same."""
    import jagg.ops.checkpoint as ckpt

    shard = tmp_path / "__0_0.distcp"
    shard.write_bytes(b"x" * 4096)
    monkeypatch.setattr(ckpt, "_file_size_limit", lambda: 4096)
    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    failure = ckpt.WriteFailure.of(err, shard)
    assert (failure.path, failure.full) == (str(shard), False)
    assert failure.reason == "File too large (EFBIG): it reached the file-size limit (ulimit -f) of 4.0 KiB"
    monkeypatch.setattr(ckpt, "_file_size_limit", lambda: None)  # unlimited: the writer's own words
    assert ckpt.WriteFailure.of(err, shard).reason == f"RuntimeError: {err}"


# --------------------------------------------------------------------------- 2 gloo ranks (FSDP2)
TWO_RANKS = (  # one prompt group of 4 split 2 + 2 over the ranks
    "train.prompts_per_iter=1",
    "train.images_per_prompt=4",
    "train.train_batch_size=2",
    "sampling.num_steps=6",
    "log.eval_every=0",
    "optim.lr=1e-3",
    "algorithm.clip_range=0.2",
)


def two_rank_async(rank: int, out_dir: str) -> None:
    """A synchronous run of 3 iterations; an asynchronous one of 2, resumed by a fresh trainer for the third."""
    out = Path(out_dir)

    def trainer(run: str, *extra):
        return build_trainer(tiny_config(out / run, *RUN, *extra, base=TWO_RANKS))

    sync = _strip(trainer("sync", "log.async_checkpoint=false").fit())
    cut = trainer("async", "log.async_checkpoint=true", "train.iterations=2")
    cut.fit()
    resumed = trainer("async", "log.async_checkpoint=true")
    resumed.load_checkpoint()
    result = {"asynchronous": [cut.checkpoints.asynchronous, resumed.checkpoints.asynchronous]}
    result.update(resumed_at=resumed.iteration, rows_equal=_strip(resumed.fit()) == sync, rows=sync)
    save_rank_result(out, rank, result)


def test_two_ranks_async_checkpoints_resume_and_equal_sync_ones(tmp_path):
    run_ranks("test_async_checkpoint:two_rank_async", 2, tmp_path, timeout=600)
    for r in rank_results(tmp_path, 2):
        assert r["asynchronous"] == [True, True] and r["resumed_at"] == 2 and r["rows_equal"]
        assert [row["iteration"] for row in r["rows"]] == [1, 2, 3]
    for name in ("checkpoint", "checkpoint.prev"):
        ckpt = tmp_path / "async" / name
        assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        _same_checkpoints(tmp_path / "sync" / name, ckpt)
    assert not (tmp_path / "async" / "checkpoint.tmp").exists()


def two_rank_poll(rank: int, out_dir: str) -> None:
    """An asynchronous save whose write is done on rank 0 but held up on rank 1 (its hashing waits): the poll
    finishes it on neither rank; once rank 1 is done, the next poll finishes it on both. The writer's gloo
    group has train.dist_timeout_s as its timeout."""
    from concurrent.futures import wait

    import jagg.ops.checkpoint as ckpt

    out = Path(out_dir)
    (out / "run").mkdir(exist_ok=True)  # fit would make it
    trainer = build_trainer(
        tiny_config(
            out / "run", *RUN, "log.async_checkpoint=true", "train.dist_timeout_s=123", base=TWO_RANKS
        )
    )
    writer = trainer.checkpoints
    gate, real = threading.Event(), ckpt.file_digest
    if rank == 1:
        ckpt.file_digest = lambda path, *a: (gate.wait(600), real(path, *a))[1]
    trainer._next_iteration(None)  # iteration 1, then its save (log.checkpoint_every=1)
    if rank == 0:
        wait([writer.pending.written])  # rank 0's part is on disk
    first = writer.poll()  # rank 1 still hashing: not finished anywhere
    first_visible = (out / "run" / "checkpoint").exists()
    gate.set()
    wait([writer.pending.written])
    second = writer.poll()
    ckpt.file_digest = real
    timeout = writer.group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    result = {"polls": [first, str(second)], "first_visible": first_visible, "group_timeout_s": timeout}
    save_rank_result(out, rank, result)


def test_two_ranks_finish_a_save_when_both_writes_are_done(tmp_path):
    run_ranks("test_async_checkpoint:two_rank_poll", 2, tmp_path, timeout=600)
    ckpt = tmp_path / "run" / "checkpoint"
    for r in rank_results(tmp_path, 2):
        assert r == {"polls": [None, str(ckpt)], "first_visible": False, "group_timeout_s": 123.0}
    verify_checkpoint(ckpt, DistInfo())
    assert read_progress(ckpt)["iteration"] == 1
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize("asynchronous", [True, False])
def test_the_writers_gloo_group_gets_the_dist_timeout(tmp_path, monkeypatch, asynchronous):
    """Under torchrun an asynchronous writer's own gloo group is made with train.dist_timeout_s (torch's
    default for a new gloo group is 30 minutes); a synchronous one makes none."""
    from datetime import timedelta

    import torch.distributed

    from jagg.ops.checkpoint import CheckpointWriter

    made = []
    monkeypatch.setattr(torch.distributed, "new_group", lambda **kw: made.append(kw) or "group")
    writer = CheckpointWriter(tmp_path, DistInfo(0, 2), keep=1, asynchronous=asynchronous, timeout_s=123)
    assert made == ([{"backend": "gloo", "timeout": timedelta(seconds=123)}] if asynchronous else [])
    assert writer.group == ("group" if asynchronous else None)
