"""Several nodes on one machine, and what depends on a process's rank on its node (LOCAL_RANK) rather than its
global rank (RANK).

* Two torchrun agents (``--nnodes 2 --nproc_per_node 1``, c10d rendezvous on 127.0.0.1, gloo on the CPU) run a
  tiny paper config (flux_dancegrpo on the tiny pipeline of the real classes, embeddings precomputed into a
  cache) through the CLI, checkpoint, and resume. Each agent's only worker has LOCAL_RANK 0; one of them has
  RANK 1.
* A node that does not see ``log.run_dir`` (each agent given its own directory, as a node-local disk would) is
  refused on every rank with exit 2 and one line, before anything is built.
* In process: the node report comes from each node's LOCAL_RANK 0 (RANK 1 included), the embedding cache is
  filled per node when it is node-local (and encoded once when shared), ``DistInfo``'s node fields, and the
  lock check that a run directory is shared.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import CountingEncoder, paper_tiny_argv
from jagg.distributed import DistInfo

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/paper/flux_dancegrpo.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_agents(argvs: list[list[str]], timeout: float = 600.0) -> list[subprocess.CompletedProcess]:
    """``torchrun --nnodes 2 --nproc_per_node 1 -m jagg.train ARGV`` as two agents (two "nodes") on localhost,
    agent i with ``argvs[i]``; agent 0 hosts the c10d rendezvous store. Returns both agents' results."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    port = _free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    procs = []
    for node, argv in enumerate(argvs):
        cmd = [
            torchrun,
            "--nnodes=2",
            "--nproc_per_node=1",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}",
            f"--rdzv_conf=is_host={int(node == 0)}",
            "--rdzv_id=jagg-multinode-test",
            "--max_restarts=0",
            "-m",
            "jagg.train",
            *argv,
        ]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
            )
        )
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from test_pretrained_pipeline import PROMPTS, save_flux_pipeline

    out = tmp_path_factory.mktemp("multinode")
    save_flux_pipeline(out / "flux")
    (out / "prompts.txt").write_text("\n".join(PROMPTS[:2]) + "\n")
    return out


def _argv(out: Path, run_dir: Path, *extra: str) -> list[str]:
    return paper_tiny_argv(
        CONFIG,
        out / "flux",
        out / "prompts.txt",
        run_dir,
        "data.precompute_embeddings=true",
        f"data.embedding_cache={out / 'emb'}",
        "log.checkpoint_every=1",
        *extra,
    )


def test_two_nodes_train_checkpoint_and_resume(pipeline):
    run = pipeline / "run"
    first = run_two_agents([_argv(pipeline, run)] * 2)
    for r in first:
        assert r.returncode == 0, r.stderr[-3000:]
    before = _rows(run)
    assert [r["iteration"] for r in before] == [0, 1]  # rank 0 alone writes the rows
    meta = json.loads((run / "run.json").read_text())
    # nodes = WORLD_SIZE / LOCAL_WORLD_SIZE as the workers saw them: 2 x 1, so RANK 1 ran with LOCAL_RANK 0
    assert meta["world_size"] == 2 and meta["nodes"] == 2
    assert sorted(p.name for p in (run / "checkpoint").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sum(o.stdout.count("done:") for o in first) == 1
    # the shared embedding cache: every prompt once, nothing re-encoded by the per-node pass
    assert len(list((pipeline / "emb").glob("*.pt"))) == 2

    resumed = run_two_agents([[*_argv(pipeline, run), "--resume", "train.iterations=2"]] * 2)
    for r in resumed:
        assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(run)
    assert [r["iteration"] for r in rows] == [0, 1, 2] and rows[:2] == before  # continued, not redone
    assert rows[-1]["optimizer_steps"] == 1 and rows[-1]["skipped_steps"] == 0
    assert torch.isfinite(torch.tensor([rows[-1]["loss"], rows[-1]["grad_norm"]])).all()
    resumes = json.loads((run / "run.json").read_text())["resumes"]
    assert [(x["world_size"], x["nodes"]) for x in resumes] == [(2, 2)]


def test_a_node_without_the_run_directory_is_refused(pipeline, monkeypatch):
    """Each agent gets its own log.run_dir, as a node-local disk would give it: every rank exits 2, one line,
    nothing written in either directory."""
    a, b = pipeline / "local_a", pipeline / "local_b"
    results = run_two_agents([_argv(pipeline, a), _argv(pipeline, b)], timeout=300)
    assert [r.returncode for r in results] != [0, 0]
    errors = [line for r in results for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert "is not the directory rank 0 locked" in errors[0] and "every node mounts" in errors[0]
    assert all(r.returncode != 0 for r in results)  # torchrun reports the worker's exit 2 as its own failure
    assert not a.exists() and not b.exists()


# --------------------------------------------------------------------------- in process: LOCAL_RANK != RANK
def test_dist_info_node_fields():
    one_node = DistInfo(rank=3, world_size=8)
    assert (one_node.local_rank, one_node.local_world_size, one_node.nodes) == (3, 8, 1)
    assert not one_node.is_node_main
    second_node = DistInfo(rank=8, world_size=16, local_rank=0, local_world_size=8)
    assert second_node.is_node_main and not second_node.is_main and second_node.nodes == 2


def test_each_node_reports_itself(monkeypatch, caplog):
    """RANK 1 with LOCAL_RANK 0 is the first process of the second node: it asks for its GPUs and reports them,
    with its host; RANK 1 with LOCAL_RANK 1 does not (it would touch GPU 0 before its device is set)."""
    from jagg.config import load_config
    from jagg.ops import node

    good = node.NodeFacts("2.14.1+cu130", "13.0", "580.65.06", "2.27.7", ("H100 (79.2 GiB)",), True)
    asked: list[bool] = []
    monkeypatch.setattr(node, "node_facts", lambda gpus=True: asked.append(gpus) or good)
    monkeypatch.setattr(node, "driver_version", lambda: good.driver)
    cfg = load_config("configs/paper/flux_dancegrpo.yaml")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with caplog.at_level("INFO", logger="jagg.node"):
        node.prepare_node(cfg, dry_run=True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    node.prepare_node(cfg, dry_run=True)
    assert asked == [True, False]
    reported = [r.getMessage() for r in caplog.records if r.name == "jagg.node"]
    assert reported and all(m.startswith(f"node {socket.gethostname()}:") for m in reported)


class _Node(DistInfo):
    """A rank of a job whose barrier is a no-op (the ranks run one after another in this process)."""

    def barrier(self) -> None:
        pass


@pytest.mark.parametrize("shared", [True, False])
def test_embedding_cache_is_complete_on_every_node(tmp_path, shared):
    """Two nodes of two ranks. A shared ``data.embedding_cache``: every prompt encoded once in all. A node-local
    one (a directory per node): each node's directory ends up holding every prompt, or a rank would need a
    prompt another node encoded after the encoders were released."""
    from jagg.scale.pipelines import CachedTextEncoder
    from jagg.scale.pretrained import precompute_embeddings

    prompts = [f"prompt {i}" for i in range(7)]
    ranks = [_Node(rank=r, world_size=4, local_rank=r % 2, local_world_size=2) for r in range(4)]
    caches = {
        r.rank: CachedTextEncoder(
            CountingEncoder(), cache_dir=tmp_path / ("all" if shared else f"node{r.rank // 2}")
        )
        for r in ranks
    }
    for info in ranks:
        precompute_embeddings(caches[info.rank], prompts, info)
    encoded = sum(c.encoder.encoded for c in caches.values())
    for c in caches.values():
        c.release()
        assert c.encode_prompts(prompts).batch_size == len(prompts)  # every prompt found, encoders gone
    assert encoded == (len(prompts) if shared else 2 * len(prompts))


def test_lock_check_tells_a_node_local_directory(tmp_path):
    from jagg.ops.rundir import RunDirLock, sees_lock

    lock = RunDirLock(tmp_path / "run")
    lock.acquire()
    try:
        holder = lock.path.read_text()
        assert sees_lock(tmp_path / "run", holder, wait_s=0) is None
        (tmp_path / "elsewhere").mkdir()
        error = sees_lock(tmp_path / "elsewhere", holder, wait_s=0)
        assert f"log.run_dir={tmp_path / 'elsewhere'}" in error and f"pid {os.getpid()}" in error
    finally:
        lock.release()
