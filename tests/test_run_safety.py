"""What a first paper-scale run needs beyond the numerics: the process group's timeout from the config, one
checkpoint at the end, a resume that checks the embedding cache without loading it, eval rewards only at
evaluation, fp32 rotary tables under bf16 FSDP2 and verified checkpoints (issue 19)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import CountingEncoder
from jagg.config import TINY_OVERRIDES, load_config
from jagg.errors import ConfigError
from jagg.ops.rundir import REPO_ROOT as ROOT
from jagg.train import main

TINY = [*TINY_OVERRIDES, "train.iterations=1", "train.prompts_per_iter=1", "train.images_per_prompt=2"]
TINY += ["train.train_batch_size=2", "sampling.num_steps=4", "log.eval_every=0"]


# --------------------------------------------------------------------------- process-group timeout
class _Stop(Exception):
    pass


@pytest.mark.parametrize(("override", "seconds"), [([], 3600), (["train.dist_timeout_s=123"], 123)])
def test_dist_timeout_reaches_init_process_group(tmp_path, monkeypatch, override, seconds):
    import torch.distributed as dist

    seen = {}

    def fake_init(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise _Stop

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    args = [
        "--config",
        "configs/world/flux_dancegrpo.yaml",
        *TINY,
        f"log.run_dir={tmp_path / 'r'}",
        *override,
    ]
    with pytest.raises(_Stop):
        main(args)
    assert seen["timeout"].total_seconds() == seconds


def test_dist_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="train.dist_timeout_s must be >= 1"):
        load_config("configs/world/flux_dancegrpo.yaml", ["train.dist_timeout_s=0"])


# --------------------------------------------------------------------------- one checkpoint at the end
def _tiny_trainer(tmp_path, *overrides):
    from jagg.loop.components import build_components
    from jagg.loop.trainer import Trainer

    cfg = load_config("configs/world/flux_dancegrpo.yaml", [*TINY, f"log.run_dir={tmp_path}", *overrides])
    return Trainer(cfg, build_components(cfg), tmp_path)


def _count_saves(monkeypatch) -> list[int]:
    import jagg.ops.checkpoint as checkpoint_module

    saved: list[int] = []
    real = checkpoint_module.start_checkpoint

    def counted(run_dir, **kw):
        saved.append(kw["progress"].iteration)
        return real(run_dir, **kw)

    monkeypatch.setattr(checkpoint_module, "start_checkpoint", counted)
    return saved


@pytest.mark.parametrize(("every", "expected"), [(1, [1, 2]), (2, [2]), (0, [2]), (3, [2])])
def test_one_checkpoint_per_iteration_at_most(tmp_path, monkeypatch, every, expected):
    saved = _count_saves(monkeypatch)
    _tiny_trainer(tmp_path, "train.iterations=2", f"log.checkpoint_every={every}").fit()
    assert saved == expected
    resumed = _tiny_trainer(tmp_path, "train.iterations=2", f"log.checkpoint_every={every}")
    resumed.load_checkpoint()
    resumed.fit()  # nothing left to train: the checkpoint it loaded is not written again
    assert saved == expected


# --------------------------------------------------------------------------- embedding cache on resume
def test_precompute_checks_the_cache_by_existence(tmp_path, monkeypatch):
    from jagg.scale.pipelines import CachedTextEncoder

    prompts = [f"prompt {i}" for i in range(5)]
    first = CachedTextEncoder(CountingEncoder(), cache_dir=tmp_path)
    assert first.precompute(prompts) == 5 and len(list(tmp_path.glob("*.pt"))) == 5
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(a) or real_load(*a, **kw))
    again = CachedTextEncoder(CountingEncoder(), cache_dir=tmp_path)  # what a resumed run builds
    assert again.precompute([*prompts, "a new one"]) == 1 and again.encoder.encoded == 1
    assert loads == []  # nothing read back to see that it is there
    again.release()
    cond = again.encode_prompts(prompts[:2])  # read when used
    assert len(loads) == 2 and cond.batch_size == 2


def test_precompute_shares_do_not_depend_on_timing(tmp_path):
    """Rank 0 finishes its share before rank 1 looks at the shared cache: every prompt is still encoded."""
    from jagg.scale.pipelines import CachedTextEncoder

    prompts = [f"prompt {i}" for i in range(5)]
    done = [
        CachedTextEncoder(CountingEncoder(), cache_dir=tmp_path).precompute(prompts, r, 2) for r in (0, 1)
    ]
    assert done == [3, 2] and len(list(tmp_path.glob("*.pt"))) == 5


# --------------------------------------------------------------------------- eval rewards at evaluation only
class _CountingReward:
    def __init__(self, device=None) -> None:  # every reward factory takes the run's device
        self.batches = 0

    def __call__(self, images, prompts):
        self.batches += 1
        return images.flatten(1).float().mean(1)


@pytest.mark.parametrize("on_train", [False, True])
def test_eval_rewards_score_training_batches_only_when_asked(tmp_path, monkeypatch, on_train):
    from jagg.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "counting_test", _CountingReward)
    trainer = _tiny_trainer(
        tmp_path,
        "reward.eval=[jpeg, counting_test]",
        "log.eval_every=1",
        "log.eval_prompts=2",
        f"log.eval_rewards_on_train={str(on_train).lower()}",
    )
    rows = trainer.fit()
    calls = trainer.sampler.eval_rewards["counting_test"].batches
    assert calls == 2 + on_train  # the evaluations at iterations 0 and 1 (+ the one training batch)
    assert ("reward_counting_test_mean" in rows[-1]) == on_train and "eval_counting_test_mean" in rows[-1]
    assert "reward_jpeg_mean" in rows[-1]  # the training reward's own score is always logged


def test_paper_configs_score_training_batches_with_the_training_reward_only():
    from pathlib import Path

    for path in sorted(Path("configs/paper").glob("*_*.yaml")):
        assert not load_config(path).log.eval_rewards_on_train, path
    assert load_config(
        "configs/world/flux_dancegrpo.yaml"
    ).log.eval_rewards_on_train  # world_rl_report reads them


# --------------------------------------------------------------------------- rotary tables stay fp32 under FSDP2
@pytest.fixture
def one_rank_group(tmp_path):
    """A world-size-1 gloo process group in this process (FSDP2 needs one), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rotary_dtypes(backbone) -> list[torch.dtype]:
    """Run one bf16-autocast forward (fp32 latents, as the trainer's); the dtypes of every tensor in the
    ``image_rotary_emb`` each block hands to its attention (after FSDP2's pre-forward hooks)."""
    from jagg.models import TextCond
    from jagg.scale.distributed import transformer_blocks

    seen: list[torch.dtype] = []

    def record(module, args, kwargs):
        seen.extend(t.dtype for t in kwargs["image_rotary_emb"])

    hooks = [
        b.attn.register_forward_pre_hook(record, with_kwargs=True)
        for b in transformer_blocks(backbone.transformer)
    ]
    g = torch.Generator().manual_seed(0)
    cond = TextCond(
        embeds=torch.randn(2, 5, 32, generator=g),
        mask=torch.ones(2, 5, dtype=torch.long),
        pooled=torch.randn(2, 32, generator=g),
    )
    z = torch.randn(2, backbone.latent_channels, 8, 8, generator=g)
    with torch.autocast("cpu", torch.bfloat16):
        out = backbone.velocity(z, torch.full((2,), 0.5), cond)
    for h in hooks:
        h.remove()
    assert torch.isfinite(out.float()).all()
    return seen


@pytest.mark.parametrize(("name", "rotary"), [("flux", torch.float32), ("qwenimage", torch.complex64)])
def test_rotary_inputs_stay_fp32_under_bf16_fsdp2(one_rank_group, name, rotary):
    from jagg.models import build_tiny_backbone
    from jagg.scale.distributed import shard_backbone
    from jagg.scale.placement import mixed_precision

    unsharded = _rotary_dtypes(build_tiny_backbone(name, seed=1))  # world size 1: no FSDP2
    sharded = _rotary_dtypes(
        shard_backbone(build_tiny_backbone(name, seed=1), mp_policy=mixed_precision("bf16"))
    )
    assert set(unsharded) == {rotary}
    assert len(sharded) == len(unsharded) and set(sharded) == {rotary}  # not cast to bf16 by FSDP2


# --------------------------------------------------------------------------- verified checkpoints
def _cli(tmp_path, *extra):
    flags = [e for e in extra if "=" not in e]  # options and their values (--allow-config-change KEY ...)
    overrides = [e for e in extra if "=" in e]
    return [
        *flags,
        "--config",
        "configs/world/flux_dancegrpo.yaml",
        *TINY,
        f"log.run_dir={tmp_path / 'run'}",
        *overrides,
    ]


def _exit_code(args) -> int:
    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code


def _damage(path, how: str) -> None:
    if how == "truncate":  # what `truncate -s 1000` does
        with open(path, "r+b") as f:
            f.truncate(1000)
    else:  # one flipped byte, same size
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("name", "how", "says"),
    [
        ("__0_0.distcp", "truncate", "truncated or corrupt (1000 bytes"),
        ("__0_0.distcp", "flip", "SHA-256 differs"),
        (".metadata", "flip", "SHA-256 differs"),
        ("progress.pt", "truncate", "truncated or corrupt (1000 bytes"),
    ],
)
def test_corrupt_checkpoint_is_one_line_exit_2(tmp_path, capsys, name, how, says):
    assert main(_cli(tmp_path)) == 0
    ckpt = tmp_path / "run" / "checkpoint"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == {p.name for p in ckpt.iterdir()} - {"manifest.json"}
    assert all(v["bytes"] == (ckpt / k).stat().st_size for k, v in manifest["files"].items())
    if name == "progress.pt" and (ckpt / name).stat().st_size <= 1000:
        pytest.skip("progress.pt is smaller than 1000 bytes")
    _damage(ckpt / name, how)
    capsys.readouterr()
    assert _exit_code(_cli(tmp_path, "--resume", "train.iterations=2")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(ckpt / name) in err and says in err
    assert "--overwrite" in err and "log.keep_checkpoints=2" in err  # what to do


def test_checkpoint_without_manifest_is_refused(tmp_path, capsys):
    """Deleting the manifest does not switch verification off: a flipped byte is not loaded unverified."""
    assert main(_cli(tmp_path)) == 0
    ckpt = tmp_path / "run" / "checkpoint"
    (ckpt / "manifest.json").unlink()
    _damage(ckpt / "__0_0.distcp", "flip")
    run_json = (tmp_path / "run" / "run.json").read_text()
    capsys.readouterr()
    assert _exit_code(_cli(tmp_path, "--resume", "train.iterations=2")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"checkpoint {ckpt} has no manifest.json" in err
    assert (tmp_path / "run" / "run.json").read_text() == run_json  # the failed resume recorded nothing


def _rows(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time_", "peak_memory"))} for r in rows]


def test_keep_two_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
    keep = ["log.checkpoint_every=1", "log.keep_checkpoints=2"]
    assert main(_cli(tmp_path, *keep, "train.iterations=2")) == 0
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint*")) == ["checkpoint", "checkpoint.prev"]
    assert torch.load(run / "checkpoint.prev" / "progress.pt", weights_only=False)["iteration"] == 1
    _damage(run / "checkpoint" / "__0_0.distcp", "truncate")
    with pytest.warns(
        UserWarning, match=r"truncated or corrupt .*resuming from .*checkpoint.prev \(iteration 1\)"
    ):
        assert main(_cli(tmp_path, *keep, "train.iterations=3", "--resume")) == 0
    assert main(_cli(tmp_path / "b", *keep, "train.iterations=3")) == 0  # uninterrupted
    assert _rows(run) == _rows(tmp_path / "b" / "run")  # iteration 2 redone exactly
    # with the default (keep 1) there is nothing to fall back to
    assert main(_cli(tmp_path / "c", "log.checkpoint_every=1", "train.iterations=2")) == 0
    assert sorted(p.name for p in (tmp_path / "c" / "run").glob("checkpoint*")) == ["checkpoint"]


# --------------------------------------------------------------------------- issue 29: a run directory loses nothing
def _tree(root) -> dict[str, str]:
    """Every path under ``root`` with its bytes' hash (directories as "dir"): what a refusal must leave as it is."""
    import hashlib

    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


def _marked(path):
    """A directory that carries this project's run marker (what --overwrite otherwise accepts)."""
    from jagg.ops.rundir import write_marker

    path.mkdir(parents=True, exist_ok=True)
    write_marker(path)
    (path / "keep.txt").write_text("must survive")
    return path


@pytest.mark.parametrize("case", ["cwd", "ancestor", "repository", "home", "runs", "foreign"])
def test_overwrite_refuses_anything_but_a_run_directory(tmp_path, monkeypatch, capsys, case):
    scratch = tmp_path / "scratch"
    runs = scratch / "runs"
    _marked(runs / "a")  # a run one level down: "runs" itself is no run directory
    cwd = _marked(scratch / "work")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(_marked(scratch / "home")))
    _marked(scratch / "repo" / ".git")
    (scratch / "foreign").mkdir()
    (scratch / "foreign" / "notes.txt").write_text("someone else's")
    target = {
        "cwd": ".",
        "ancestor": str(scratch),
        "repository": str(scratch / "repo"),
        "home": str(scratch / "home"),
        "runs": str(runs),
        "foreign": str(scratch / "foreign"),
    }[case]
    why = {
        "cwd": "working directory",
        "ancestor": "working directory or one of its ancestors",
        "repository": "git repository's root",
        "home": "home directory",
        "runs": "not a run directory of this project",
        "foreign": "not a run directory of this project",
    }[case]
    before = _tree(scratch)
    capsys.readouterr()
    argv = [a.replace("configs/", f"{ROOT}/configs/") for a in _cli(tmp_path, "--overwrite")]
    assert _exit_code([*argv, f"log.run_dir={target}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite refuses to delete" in err and why in err, err
    assert _tree(scratch) == before  # nothing deleted, no lock left behind


def test_without_overwrite_a_foreign_directory_is_not_offered_to_it(tmp_path, capsys):
    foreign = tmp_path / "run"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone else's")
    assert _exit_code(_cli(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert "not a run directory of this project" in err and "--overwrite" not in err


def test_overwrite_replaces_a_run_directory(tmp_path):
    assert main(_cli(tmp_path)) == 0
    run = tmp_path / "run"
    (run / "hang_rank0.txt").write_text("from the old run")  # what a run writes (jagg.ops.heartbeat)
    assert main(_cli(tmp_path, "--overwrite")) == 0
    assert not (run / "hang_rank0.txt").exists() and (run / ".jagg_run").is_file()
    assert len(_rows(run)) == 1 and not (run / ".lock").exists()  # released on exit


HOLD = (  # a process that holds a run directory's lock until killed, as a live training does
    "import sys, time\nfrom jagg.ops.rundir import RunDirLock\n"
    "RunDirLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(600)\n"
)


def test_resume_auto_against_a_live_run_exits_2_naming_it_and_a_killed_holder_is_stale(tmp_path, capsys):
    import os
    import signal
    import subprocess
    import sys

    assert main(_cli(tmp_path)) == 0
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    live = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert live.stdout.readline().strip() == "locked"
        before = _tree(run)
        capsys.readouterr()
        assert _exit_code(_cli(tmp_path, "--resume=auto", "train.iterations=2")) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"is in use by another training run (pid {live.pid} on" in err
        assert _tree(run) == before  # joined nothing, wrote nothing
    finally:
        live.send_signal(signal.SIGKILL)  # kill -9: the lock file stays, its flock goes with the process
        live.wait()
    assert (run / ".lock").is_file()
    assert main(_cli(tmp_path, "--resume=auto", "train.iterations=2")) == 0  # a stale lock: taken over
    assert [r["iteration"] for r in _rows(run)] == [1, 2] and not (run / ".lock").exists()


def test_two_trainings_started_at_once_one_runs_one_exits_2(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "jagg.train",
        *_cli(tmp_path, "train.iterations=3", "log.checkpoint_every=1"),
    ]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    ]
    procs.append(
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    )
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    loser = next(err for p, (_, err) in zip(procs, outs, strict=True) if p.returncode == 2).strip()
    assert len(loser.splitlines()) == 1, loser
    # at once: the loser meets the lock; later than the winner's end: a finished run it may not replace
    assert "is in use by another training run (pid" in loser or "already exists" in loser, loser
    assert [r["iteration"] for r in _rows(tmp_path / "run")] == [1, 2, 3]  # one writer's rows, in order


def two_rank_lock(rank: int, out_dir: str) -> None:
    """Both ranks get rank 0's refusal of a locked directory; in a free one rank 0 alone holds the lock, and
    another process (rank 1 stands in for it) cannot take it meanwhile."""
    import torch.distributed as dist

    from dist_harness import save_rank_result
    from jagg.distributed import DistInfo
    from jagg.errors import ConfigError
    from jagg.ops.rundir import RunDirLock, hold

    out, info, result = Path(out_dir), DistInfo.current(), {}
    try:
        with hold(out / "busy", info):
            result["busy"] = "entered"
    except ConfigError as err:
        result["busy"] = str(err)
    with hold(out / "free", info) as lock:
        result["holds"] = lock is not None
        dist.barrier()
        if rank == 1:
            try:
                RunDirLock(out / "free").acquire()
                result["second"] = "acquired"
            except ConfigError as err:
                result["second"] = str(err)
        dist.barrier()
    save_rank_result(out_dir, rank, result)


def test_lock_across_ranks(tmp_path):
    import os

    from dist_harness import rank_results, run_ranks
    from jagg.ops.rundir import RunDirLock

    busy = RunDirLock(tmp_path / "busy")
    busy.acquire()  # this process is the other training
    try:
        run_ranks("test_run_safety:two_rank_lock", 2, tmp_path, timeout=300)
    finally:
        busy.release()
    r0, r1 = rank_results(tmp_path, 2)
    assert r0["busy"] == r1["busy"] and f"in use by another training run (pid {os.getpid()} on" in r0["busy"]
    assert (r0["holds"], r1["holds"]) == (True, False)
    assert "in use by another training run" in r1["second"]
    assert (
        not (tmp_path / "free").exists() and not (tmp_path / "busy").exists()
    )  # released, created dirs gone


def test_resume_auto_reports_an_incomplete_checkpoint_and_discards_nothing(tmp_path, capsys):
    assert main(_cli(tmp_path)) == 0
    run = tmp_path / "run"
    (run / "checkpoint" / ".metadata").unlink()
    before = _tree(run)
    capsys.readouterr()
    assert _exit_code(_cli(tmp_path, "--resume=auto", "train.iterations=2")) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1
        and f"checkpoint {run / 'checkpoint'} is incomplete (.metadata missing)" in err
    )
    assert _tree(run) == before  # not restarted from iteration 0 over the run


def test_an_incomplete_checkpoint_falls_back_to_an_intact_previous_one(tmp_path):
    keep = ["log.checkpoint_every=1", "log.keep_checkpoints=2"]
    assert main(_cli(tmp_path, *keep, "train.iterations=2")) == 0
    run = tmp_path / "run"
    (run / "checkpoint" / ".metadata").unlink()
    with pytest.warns(
        UserWarning, match=r"incomplete \(.metadata missing\).*checkpoint.prev \(iteration 1\)"
    ):
        assert main(_cli(tmp_path, *keep, "train.iterations=3", "--resume=auto")) == 0
    assert [r["iteration"] for r in _rows(run)] == [1, 2, 3]


@pytest.mark.parametrize("case", ["a file", "under a file", "read-only"])
def test_unusable_run_dir_is_one_line_before_the_model(tmp_path, monkeypatch, capsys, case):
    import errno
    import os

    import jagg.loop.components as components

    (tmp_path / "file").write_text("not a directory")
    run_dir = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "run"}.get(
        case, tmp_path / "ro"
    )
    if case == "read-only":  # root ignores chmod: the lock file's creation fails as on a read-only directory
        run_dir.mkdir()
        real_open = os.open

        def read_only(path, *args, **kw):
            if str(path).startswith(str(run_dir)):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, *args, **kw)

        monkeypatch.setattr(os, "open", read_only)
    monkeypatch.setattr(components, "build_components", lambda cfg: pytest.fail("built the model first"))
    before = _tree(tmp_path)
    assert _exit_code([*_cli(tmp_path), f"log.run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    says = {
        "a file": "is a file, not a directory",
        "under a file": f"lies under {tmp_path / 'file'}, which is a file",
    }
    assert len(err.splitlines()) == 1 and says.get(case, "is not writable (Permission denied)") in err, err
    assert _tree(tmp_path) == before


def _fake_disk(monkeypatch, free: int) -> None:
    import shutil

    import jagg.ops.checkpoint as ckpt

    usage = shutil.disk_usage("/")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage._replace(free=free))


def test_free_space_is_checked_before_a_save(tmp_path, monkeypatch, capsys):
    _fake_disk(monkeypatch, free=1000)
    assert _exit_code(_cli(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    run = tmp_path / "run"
    assert len(err.splitlines()) == 1 and f"not enough disk space for checkpoint {run / 'checkpoint'}" in err
    assert "1000 B free" in err and "needed" in err
    assert not list(run.glob("checkpoint*"))  # nothing started


def test_disk_full_while_saving_is_one_line_and_the_next_start_cleans_up(tmp_path, monkeypatch, capsys):
    import errno

    import torch.distributed.checkpoint as dcp

    assert main(_cli(tmp_path, "log.checkpoint_every=1")) == 0
    run = tmp_path / "run"

    def full(state, checkpoint_id, **kw):
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp, "save", full)
    capsys.readouterr()
    assert _exit_code(_cli(tmp_path, "--resume", "train.iterations=2", "log.checkpoint_every=1")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"disk full while writing checkpoint {run / 'checkpoint'}" in err
    assert " free on " in err and " needed" in err
    assert not (run / "checkpoint.tmp").exists()  # the partial save is gone
    monkeypatch.undo()
    (run / "checkpoint.tmp").mkdir()  # what a kill -9 during a save leaves
    (run / "checkpoint.tmp" / "__0_0.distcp").write_bytes(b"partial")
    (run / ".run.json.abc123.tmp").write_text("{")  # and during an atomic write
    assert main(_cli(tmp_path, "--resume", "train.iterations=2", "log.checkpoint_every=1")) == 0
    assert not (run / "checkpoint.tmp").exists() and not list(run.glob(".*.tmp"))
    assert [r["iteration"] for r in _rows(run)] == [1, 2]


SECOND_WRITE_NEVER_ENDS = (  # jagg.train whose second checkpoint write hangs (a slow disk) until killed
    "import sys, time\nfrom pathlib import Path\n"
    "from torch.distributed.checkpoint.filesystem import FileSystemWriter\nfrom jagg.train import main\n"
    "calls, real = [], FileSystemWriter.write_data\n"
    "def write_data(self, plan, planner):\n"
    "    calls.append(1)\n"
    "    if len(calls) == 2:\n"
    "        Path(sys.argv[1]).write_text('in flight')\n"
    "        time.sleep(600)\n"
    "    return real(self, plan, planner)\n"
    "FileSystemWriter.write_data = write_data\nsys.exit(main(sys.argv[2:]))\n"
)


def _iterations_logged(run) -> list[int]:
    """The iterations of metrics.jsonl's complete lines (a live run may be writing the last one)."""
    path = run / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(x)["iteration"] for x in lines]


def _kill_9_when(tmp_path: Path, script: str, argv: list[str], ready, poll: float = 0.2, settle: float = 0.0):
    """Run ``python -c script *argv`` (the CLI with a hook that stalls it somewhere) from the repository root,
    its output in ``tmp_path/log.txt``; once ``ready()`` holds (and ``settle`` seconds more), kill -9 it. A
    process that ends first, or 600 s without ``ready()``, fails the test with its log."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, *argv], stdout=log, stderr=log, env=env, cwd=ROOT
        )
        try:
            deadline = time.monotonic() + 600
            while not ready():
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log.txt").read_text()
                time.sleep(poll)
            time.sleep(settle)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


def test_kill_9_during_an_async_write_resumes_from_the_newest_complete_checkpoint(tmp_path):
    """The second save (iteration 2) of a run with log.async_checkpoint never finishes writing; training goes
    on (iteration 3 is logged) until the next save waits for it, then kill -9. What is left: iteration 1's
    checkpoint, complete and verified, and checkpoint.tmp/; the resume removes the latter, redoes iterations
    2-4 and ends where an uninterrupted synchronous run ends."""
    from jagg.distributed import DistInfo
    from jagg.ops.checkpoint import find_checkpoint, read_checkpoint, read_progress, verify_checkpoint

    run, marker = tmp_path / "run", tmp_path / "in_flight"
    every = ["train.iterations=4", "log.checkpoint_every=1"]
    args = _cli(tmp_path, *every, "log.async_checkpoint=true")
    _kill_9_when(
        tmp_path,
        SECOND_WRITE_NEVER_ENDS,
        [str(marker), *args],
        lambda: marker.exists() and 3 in _iterations_logged(run),
    )
    assert find_checkpoint(run) == run / "checkpoint" and read_progress(run / "checkpoint")["iteration"] == 1
    verify_checkpoint(run / "checkpoint", DistInfo())
    assert (run / "checkpoint.tmp").is_dir() and not (run / "checkpoint.tmp" / "manifest.json").exists()
    assert main(_cli(tmp_path, "--resume", *every, "log.async_checkpoint=true")) == 0
    assert sorted(p.name for p in run.glob("checkpoint*")) == ["checkpoint"]
    assert main(_cli(tmp_path / "b", *every)) == 0  # uninterrupted, synchronous
    assert _rows(run) == _rows(tmp_path / "b" / "run") and [r["iteration"] for r in _rows(run)] == [
        1,
        2,
        3,
        4,
    ]
    resumed, uninterrupted = (
        read_checkpoint(run / "checkpoint"),
        read_checkpoint(tmp_path / "b" / "run" / "checkpoint"),
    )
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


def test_a_moved_run_directory_resumes(tmp_path):
    import shutil

    assert main(_cli(tmp_path / "a")) == 0
    shutil.move(tmp_path / "a" / "run", tmp_path / "b")
    assert (
        main([*_cli(tmp_path / "b", "--resume", "train.iterations=2"), f"log.run_dir={tmp_path / 'b'}"]) == 0
    )
    meta = json.loads((tmp_path / "b" / "run.json").read_text())
    assert meta["resumes"][0]["config_changes"]["log.run_dir"] == [
        str(tmp_path / "a" / "run"),
        str(tmp_path / "b"),
    ]
    assert [r["iteration"] for r in _rows(tmp_path / "b")] == [1, 2]


def test_disk_full_in_any_write_is_one_line(tmp_path, monkeypatch, capsys):
    import errno

    import jagg.ops.trackers as trackers_module

    assert main(_cli(tmp_path)) == 0
    run = tmp_path / "run"

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(trackers_module, "atomic_write_text", full)  # the resume rewrites metrics.jsonl
    capsys.readouterr()
    assert _exit_code(_cli(tmp_path, "--resume", "train.iterations=2")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"disk full while writing {run / 'metrics.jsonl'}" in err
    assert " free on " in err


@pytest.mark.parametrize("holder", ["dead", "live", "other host"])
def test_lock_without_flock_checks_the_recorded_pid_and_host(tmp_path, monkeypatch, holder):
    """Where the filesystem has no flock, the holder's record decides: a dead pid on this host is stale, a live
    one or one on another host (which cannot be checked from here) holds the directory."""
    import errno
    import fcntl
    import os
    import socket
    import subprocess
    import sys

    from jagg.ops import rundir

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = {"dead": int(dead.stdout), "live": os.getppid(), "other host": os.getppid()}[holder]
    host = "elsewhere.invalid" if holder == "other host" else socket.gethostname()
    (tmp_path / ".lock").write_text(
        json.dumps({"pid": pid, "start": rundir.process_start(pid), "host": host})
    )
    lock = rundir.RunDirLock(tmp_path)
    if holder == "dead":
        lock.acquire()
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        lock.release()
        assert not (tmp_path / ".lock").exists()
    else:
        with pytest.raises(ConfigError, match=f"in use by another training run \\(pid {pid} on {host}"):
            lock.acquire()


# --------------------------------------------------------------------------- issue 41: the retry loop cannot stick
def _equals_uninterrupted(run: Path, tmp_path: Path, *args: str) -> None:
    """``run``'s metrics rows (timings left out) and checkpoint tensors are bitwise those of an uninterrupted,
    synchronous run of ``args``."""
    from jagg.ops.checkpoint import read_checkpoint

    fresh = tmp_path / "uninterrupted"
    assert main(_cli(fresh, *args)) == 0
    assert _rows(run) == _rows(fresh / "run")
    got, want = read_checkpoint(run / "checkpoint"), read_checkpoint(fresh / "run" / "checkpoint")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_resume_auto_restarts_a_run_preempted_before_its_first_checkpoint(tmp_path, capsys):
    """run.json and metrics rows but no checkpoint (a kill after the first row, before the first save): nothing
    is lost by starting again, so --resume auto does, drops the rows and records it; a second time too."""
    assert main(_cli(tmp_path, "train.iterations=2")) == 0
    run = tmp_path / "run"
    shutil.rmtree(run / "checkpoint")
    (run / "checkpoint.tmp").mkdir()  # a save the kill cut short
    (run / "checkpoint.tmp" / "__0_0.distcp").write_bytes(b"partial")
    capsys.readouterr()
    assert main(_cli(tmp_path, "--resume=auto", "train.iterations=2")) == 0
    out = capsys.readouterr().out
    assert "no checkpoint yet (preempted before the first one): starting again from iteration 0" in out
    assert "2 metrics rows dropped" in out
    meta = json.loads((run / "run.json").read_text())
    assert [(r["metrics_rows_dropped"], "--resume=auto" in r["argv"]) for r in meta["restarts"]] == [
        (2, True)
    ]
    assert "resumes" not in meta and not (run / "checkpoint.tmp").exists()
    _equals_uninterrupted(run, tmp_path, "train.iterations=2")
    shutil.rmtree(run / "checkpoint")  # preempted again: the earlier restart stays on record
    assert main(_cli(tmp_path, "--resume=auto", "train.iterations=2")) == 0
    assert len(json.loads((run / "run.json").read_text())["restarts"]) == 2


FIRST_SAVE_NEVER_ENDS = (  # jagg.train whose first checkpoint write hangs (a slow disk) until killed
    "import sys, time\nfrom pathlib import Path\n"
    "from torch.distributed.checkpoint.filesystem import FileSystemWriter\nfrom jagg.train import main\n"
    "def write_data(self, plan, planner):\n"
    "    Path(sys.argv[1]).write_text('in flight')\n"
    "    time.sleep(600)\n"
    "FileSystemWriter.write_data = write_data\nsys.exit(main(sys.argv[2:]))\n"
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_before_the_first_checkpoint_then_resume_auto(tmp_path, mode):
    """kill -9 while the first (and only, at the end) save is being written, after every metrics row: the retry
    loop's --resume auto starts again and ends bitwise where an uninterrupted run ends."""
    from jagg.ops.checkpoint import find_checkpoint

    run, marker = tmp_path / "run", tmp_path / "in_flight"
    every = [
        "train.iterations=2",
        "log.checkpoint_every=0",
        f"log.async_checkpoint={str(mode == 'async').lower()}",
    ]
    _kill_9_when(
        tmp_path,
        FIRST_SAVE_NEVER_ENDS,
        [str(marker), *_cli(tmp_path, *every)],
        lambda: marker.exists() and _iterations_logged(run) == [1, 2],
    )
    assert find_checkpoint(run) is None and (run / "checkpoint.tmp").is_dir()
    assert main(_cli(tmp_path, "--resume=auto", *every)) == 0
    assert json.loads((run / "run.json").read_text())["restarts"][0]["metrics_rows_dropped"] == 2
    _equals_uninterrupted(run, tmp_path, "train.iterations=2")


def _unfinished(run: Path, damage: bool = False) -> None:
    """Turn the newest checkpoint into the save a kill left unfinished in checkpoint.tmp/ (no manifest yet, not
    swapped in) and the kept previous one back into checkpoint/; ``damage``: one shard cut short as well."""
    (run / "checkpoint").rename(run / "checkpoint.tmp")
    (run / "checkpoint.tmp" / "manifest.json").unlink()
    if damage:
        _damage(run / "checkpoint.tmp" / "__0_0.distcp", "truncate")
    if (run / "checkpoint.prev").exists():
        (run / "checkpoint.prev").rename(run / "checkpoint")


@pytest.mark.parametrize("which", ["first", "second"])
def test_a_complete_save_in_checkpoint_tmp_is_promoted_not_deleted(tmp_path, capsys, which):
    """An asynchronous save that finished writing but was not yet swapped in (it becomes visible only when the
    next one starts) is the newest checkpoint: --resume auto promotes it and goes on from there."""
    from jagg.ops.checkpoint import read_progress

    keep = ["log.checkpoint_every=1", "log.keep_checkpoints=2"]
    done = 1 if which == "first" else 2
    assert main(_cli(tmp_path, *keep, f"train.iterations={done}")) == 0
    run = tmp_path / "run"
    _unfinished(run)
    capsys.readouterr()
    assert main(_cli(tmp_path, "--resume=auto", *keep, "train.iterations=3")) == 0
    out = capsys.readouterr().out
    assert f"promoted {run / 'checkpoint.tmp'} (iteration {done})" in out and f"at iteration {done}" in out
    (resume,) = json.loads((run / "run.json").read_text())["resumes"]
    assert resume["promoted_checkpoint_tmp"] == done and resume["metrics_rows_dropped"] == 0
    assert read_progress(run / "checkpoint.prev")["iteration"] == 2  # the promoted save, rotated as usual
    _equals_uninterrupted(run, tmp_path, *keep, "train.iterations=3")


def test_an_incomplete_save_is_not_promoted_and_rows_past_the_checkpoint_are_dropped(tmp_path, capsys):
    """checkpoint.tmp/ with .metadata and progress.pt but a shard cut short is not a save: removed; the resume
    goes on from iteration 1, and iteration 2's row (past that checkpoint) is dropped, recorded and redone."""
    keep = ["log.checkpoint_every=1", "log.keep_checkpoints=2"]
    assert main(_cli(tmp_path, *keep, "train.iterations=2")) == 0
    run = tmp_path / "run"
    _unfinished(run, damage=True)
    capsys.readouterr()
    assert main(_cli(tmp_path, "--resume=auto", *keep, "train.iterations=3")) == 0
    out = capsys.readouterr().out
    assert "promoted" not in out and f"removed {run / 'checkpoint.tmp'}" in out
    assert "metrics.jsonl: 1 rows past the checkpoint dropped" in out
    (resume,) = json.loads((run / "run.json").read_text())["resumes"]
    assert resume["promoted_checkpoint_tmp"] is None and resume["metrics_rows_dropped"] == 1
    _equals_uninterrupted(run, tmp_path, *keep, "train.iterations=3")


# --------------------------------------------------------------------------- issue 41: signals
SIGNAL_IN_ITERATION_2 = (  # jagg.train that receives the signal sys.argv[1] while iteration 2 is rolled out
    "import os, signal, sys\nimport jagg.loop.rollout as rollout\nfrom jagg.train import main\n"
    "real = rollout.Sampler.__call__\n"
    "def call(self, it, *args, **kw):\n"
    "    if it == 1:\n"
    "        os.kill(os.getpid(), getattr(signal, sys.argv[1]))\n"
    "    return real(self, it, *args, **kw)\n"
    "rollout.Sampler.__call__ = call\nsys.exit(main(sys.argv[2:]))\n"
)


def _cli_process(tmp_path: Path, script: str, *args: str, timeout: float = 600):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-c", script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


@pytest.mark.parametrize(("name", "status"), [("SIGTERM", 143), ("SIGUSR1", 138)])
def test_sigterm_finishes_the_iteration_saves_and_resumes_bitwise(tmp_path, name, status):
    """SIGTERM / SIGUSR1 mid-iteration 2 of 3: iteration 2 completes, its checkpoint is written, the exit status
    says which signal, one line on stderr; --resume auto then ends bitwise where an uninterrupted run ends."""
    from jagg.distributed import DistInfo
    from jagg.ops.checkpoint import find_checkpoint, read_progress, verify_checkpoint

    run = tmp_path / "run"
    done = _cli_process(tmp_path, SIGNAL_IN_ITERATION_2, name, *_cli(tmp_path, "train.iterations=3"))
    assert done.returncode == status, done.stderr
    err = done.stderr.strip()
    assert len(err.splitlines()) == 1 and f"stopped by {name} after iteration 2" in err, err
    assert f"checkpoint {run / 'checkpoint'} written" in err and "--resume" in err
    assert find_checkpoint(run) == run / "checkpoint" and read_progress(run / "checkpoint")["iteration"] == 2
    verify_checkpoint(run / "checkpoint", DistInfo())
    assert [r["iteration"] for r in _rows(run)] == [1, 2] and not (run / ".lock").exists()
    assert main(_cli(tmp_path, "--resume=auto", "train.iterations=3")) == 0
    _equals_uninterrupted(run, tmp_path, "train.iterations=3")


def test_sigint_stops_with_one_line_and_no_traceback(tmp_path):
    run = tmp_path / "run"
    done = _cli_process(tmp_path, SIGNAL_IN_ITERATION_2, "SIGINT", *_cli(tmp_path, "train.iterations=3"))
    assert done.returncode == 130, done.stderr
    err = done.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "interrupted (SIGINT)" in err, err
    assert [r["iteration"] for r in _rows(run)] == [1] and not (run / ".lock").exists()


SLOW_ITERATIONS = (  # jagg.train whose iterations after the first take 2 s longer (time for a signal to land)
    "import sys, time\nimport jagg.loop.rollout as rollout\nfrom jagg.train import main\n"
    "real = rollout.Sampler.__call__\n"
    "def call(self, it, *args, **kw):\n"
    "    if it >= 1:\n"
    "        time.sleep(2)\n"
    "    return real(self, it, *args, **kw)\n"
    "rollout.Sampler.__call__ = call\nsys.exit(main(sys.argv[1:]))\n"
)


def test_sigterm_from_outside_after_the_first_row(tmp_path):
    """The drill's case: SIGTERM sent by another process once the first metrics row is there."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from jagg.ops.checkpoint import read_progress

    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-c", SLOW_ITERATIONS, *_cli(tmp_path, "train.iterations=4")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 600
        while not _iterations_logged(run):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 143 and len(err.strip().splitlines()) == 1 and "stopped by SIGTERM" in err, err
    reached = _iterations_logged(run)
    assert reached in ([1, 2], [1, 2, 3]) and read_progress(run / "checkpoint")["iteration"] == reached[-1]
    assert main(_cli(tmp_path, "--resume=auto", "train.iterations=4")) == 0
    _equals_uninterrupted(run, tmp_path, "train.iterations=4")


def two_rank_stop(rank: int, out_dir: str) -> None:
    """A stop signal that reached rank 1 alone stops both ranks after the same iteration."""
    import signal

    from dist_harness import save_rank_result
    from jagg.distributed import DistInfo
    from jagg.ops.signals import StopFlag

    info, flag = DistInfo.current(), StopFlag()
    before = flag.agreed(info)
    if rank == 1:
        flag(signal.SIGTERM, None)  # what the handler does when the signal lands
    save_rank_result(out_dir, rank, {"before": before, "after": flag.agreed(info)})


def test_a_signal_on_one_rank_stops_every_rank(tmp_path):
    import signal

    from dist_harness import rank_results, run_ranks

    run_ranks("test_run_safety:two_rank_stop", 2, tmp_path, timeout=300)
    assert rank_results(tmp_path, 2) == [{"before": None, "after": int(signal.SIGTERM)}] * 2


HANG_IN_ROLLOUT = (  # jagg.train that hangs in the rollout of iteration int(sys.argv[2]) + 1 until killed
    "import sys, time\nfrom pathlib import Path\nimport jagg.loop.rollout as rollout\nfrom jagg.train import main\n"
    "real = rollout.Sampler.__call__\n"
    "def call(self, it, *args, **kw):\n"
    "    if it == int(sys.argv[2]):\n"
    "        Path(sys.argv[1]).write_text('hanging')\n"
    "        time.sleep(600)\n"
    "    return real(self, it, *args, **kw)\n"
    "rollout.Sampler.__call__ = call\nsys.exit(main(sys.argv[3:]))\n"
)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("at", [0, 1, 2])
def test_kill_9_in_each_of_the_first_3_iterations_then_resume_auto(tmp_path, mode, at):
    """kill -9 in the rollout of iteration at + 1 of 3 (a checkpoint after every iteration): with synchronous
    saves the checkpoint of iteration ``at`` is there; with asynchronous ones it is still in checkpoint.tmp/,
    complete, and is promoted. Either way --resume auto ends bitwise where an uninterrupted run ends."""
    run, marker = tmp_path / "run", tmp_path / "hanging"
    args = [
        "train.iterations=3",
        "log.checkpoint_every=1",
        f"log.async_checkpoint={str(mode == 'async').lower()}",
    ]
    pending = run / "checkpoint.tmp" / "progress.pt"
    _kill_9_when(
        tmp_path,
        HANG_IN_ROLLOUT,
        [str(marker), str(at), *_cli(tmp_path, *args)],
        lambda: marker.exists() and (mode == "sync" or at == 0 or pending.exists()),
        poll=0.1,
        settle=0.5,  # let a background write finish its last bytes
    )
    assert _iterations_logged(run) == list(range(1, at + 1))
    assert main(_cli(tmp_path, "--resume=auto", *args)) == 0
    meta = json.loads((run / "run.json").read_text())
    if at == 0:  # nothing saved yet: started again
        assert "resumes" not in meta and meta["restarts"][0]["metrics_rows_dropped"] == 0
    else:
        assert meta["resumes"][0]["promoted_checkpoint_tmp"] == (at if mode == "async" else None)
    _equals_uninterrupted(run, tmp_path, "train.iterations=3", "log.checkpoint_every=1")


# --------------------------------------------------------------------------- issue 41, part 2
def test_tilde_in_run_dir_is_the_home_directory(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    argv = [a.replace("configs/", f"{ROOT}/configs/") for a in _cli(tmp_path)]
    assert main([*argv, "log.run_dir=~/x"]) == 0
    assert json.loads((home / "x" / "run.json").read_text())["config"]["log"]["run_dir"] == str(home / "x")
    assert list(cwd.iterdir()) == []  # no directory literally named ~


def test_overwrite_refuses_a_forged_marker_beside_foreign_files(tmp_path, capsys):
    forged = _marked(tmp_path / "run")  # .jagg_run beside keep.txt, which no run writes
    before = _tree(tmp_path / "run")
    capsys.readouterr()
    assert _exit_code(_cli(tmp_path, "--overwrite")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite refuses" in err and "'keep.txt'" in err, err
    assert _tree(forged) == before and (forged / "keep.txt").read_text() == "must survive"


def test_a_run_writes_only_what_overwrite_may_delete(tmp_path):
    """Every writer on (evaluations, grids, eval states, two checkpoints, TensorBoard): all of it is in
    ``RUN_ENTRIES``, so ``--overwrite`` can replace the run; a file of someone else's would not be."""
    from jagg.ops.rundir import foreign_entries

    every = ["log.eval_every=1", "log.eval_prompts=2", "log.checkpoint_every=1", "log.keep_checkpoints=2"]
    every += ["log.save_eval_state=true", "log.report_to=[tensorboard]", "train.iterations=2"]
    assert main(_cli(tmp_path, *every)) == 0
    run = tmp_path / "run"
    assert {"samples", "tensorboard", "checkpoint.prev"} <= {p.name for p in run.iterdir()}
    assert foreign_entries(run) == []
    (run / "notes.txt").write_text("mine")
    assert [p.name for p in foreign_entries(run)] == ["notes.txt"]


@pytest.mark.parametrize("record", ["deleted", "edited"])
def test_resume_compares_the_checkpoints_own_config(tmp_path, capsys, record):
    """Neither a deleted nor an edited run.json hides a change from the config the checkpoint was trained with."""
    assert main(_cli(tmp_path)) == 0
    meta_path = tmp_path / "run" / "run.json"
    if record == "deleted":
        meta_path.unlink()
    else:  # run.json made to agree with the changed seed
        meta = json.loads(meta_path.read_text())
        meta["config"]["train"]["seed"] = 7
        meta_path.write_text(json.dumps(meta))
    before = _tree(tmp_path / "run")
    capsys.readouterr()
    assert _exit_code(_cli(tmp_path, "--resume", "train.iterations=2", "train.seed=7")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.seed: 0 -> 7" in err and "progress.pt" in err, err
    assert _tree(tmp_path / "run") == before
    # --allow-config-change keeps its meaning: the change is made, and recorded
    assert (
        main(
            _cli(
                tmp_path,
                "--resume",
                "--allow-config-change",
                "train.seed",
                "train.iterations=2",
                "train.seed=7",
            )
        )
        == 0
    )
    assert [r["iteration"] for r in _rows(tmp_path / "run")] == [1, 2]


def test_resume_applies_a_changed_learning_rate(tmp_path):
    assert main(_cli(tmp_path)) == 0
    changed = [
        "--resume",
        "--allow-config-change",
        "optim.lr",
        "optim.weight_decay",
        "train.iterations=2",
        "optim.lr=0.5",
        "optim.weight_decay=0.25",
    ]
    assert main(_cli(tmp_path, *changed)) == 0
    rows = _rows(tmp_path / "run")
    assert [r["lr"] for r in rows] == [load_config("configs/world/flux_dancegrpo.yaml").optim.lr, 0.5]


def test_resume_applies_every_optimizer_setting(tmp_path):
    """lr, weight decay, betas and eps reach the restored optimizer's param groups (the checkpoint's come back)."""
    from jagg.loop.components import build_components
    from jagg.loop.trainer import Trainer

    _tiny_trainer(tmp_path).fit()
    new = ["optim.lr=0.5", "optim.weight_decay=0.25", "optim.betas=[0.5, 0.75]", "optim.eps=0.001"]
    cfg = load_config("configs/world/flux_dancegrpo.yaml", [*TINY, f"log.run_dir={tmp_path}", *new])
    trainer = Trainer(cfg, build_components(cfg), tmp_path)
    trainer.load_checkpoint()
    group = trainer.optimizer.param_groups[0]
    assert trainer.optimizer.state  # the checkpoint's moments were loaded
    assert (group["lr"], group["weight_decay"], tuple(group["betas"]), group["eps"]) == (
        0.5,
        0.25,
        (0.5, 0.75),
        0.001,
    )


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (["model.lora_rank=2", "model.lora_alpha=2"], "model.lora_rank"),
        (["optim.ema_decay=0"], "optim.ema_decay"),
    ],
)
def test_a_change_the_checkpoint_cannot_take_is_refused_even_when_allowed(tmp_path, capsys, change, key):
    assert main(_cli(tmp_path)) == 0
    before = _tree(tmp_path / "run")
    capsys.readouterr()
    allow = ["--allow-config-change", key, "model.lora_alpha"]
    assert _exit_code(_cli(tmp_path, "--resume", *allow, "train.iterations=2", *change)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err and "even with --allow-config-change" in err, err
    assert _tree(tmp_path / "run") == before


@pytest.mark.parametrize("content", ["latin-1", "binary", "unreadable"])
def test_an_unreadable_config_file_is_one_line(tmp_path, monkeypatch, capsys, content):
    path = tmp_path / "bad.yaml"
    data = {
        "latin-1": b"log:\n  run_dir: caf\xe9\n",
        "binary": b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
        "unreadable": b"x: 1\n",
    }
    path.write_bytes(data[content])
    if content == "unreadable":  # chmod 000 does not stop root: the read itself fails
        real = Path.read_text

        def denied(self, *a, **kw):
            if self == path:
                raise PermissionError(13, "Permission denied", str(self))
            return real(self, *a, **kw)

        monkeypatch.setattr(Path, "read_text", denied)
    assert _exit_code(["--config", str(path), f"log.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    says = "Permission denied" if content == "unreadable" else "is not a UTF-8 text file"
    assert len(err.splitlines()) == 1 and str(path) in err and says in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "corrupt", ['{"config": {"train": {"seed"', "[1, 2]", '{"git_sha": "x", "config": null, "argv": []}']
)
def test_a_corrupt_run_json_on_resume_is_one_line(tmp_path, capsys, corrupt):
    assert main(_cli(tmp_path)) == 0
    (tmp_path / "run" / "run.json").write_text(corrupt)
    before = _tree(tmp_path / "run")
    capsys.readouterr()
    assert _exit_code(_cli(tmp_path, "--resume", "train.iterations=2")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run.json is corrupt" in err and "delete it" in err, err
    assert _tree(tmp_path / "run") == before


def test_a_nul_byte_in_run_dir_is_one_line(tmp_path, capsys):
    path = tmp_path / "nul.yaml"  # a command line cannot hold a NUL byte; YAML's "\0" escape can
    path.write_text(
        f'inherit: {ROOT}/configs/world/flux_dancegrpo.yaml\nlog:\n  run_dir: "{tmp_path}/a\\0b"\n'
    )
    assert _exit_code(["--config", str(path), *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "log.run_dir must be a non-empty path without NUL bytes" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nul.yaml"]


# --------------------------------------------------------------------------- issue 40: checkpoints final when written
def test_the_cli_finishes_an_async_save_at_the_first_boundary_after_its_write(tmp_path, monkeypatch):
    """With log.checkpoint_every=2 the save of iteration 2 is the checkpoint from the boundary after iteration
    3 (its write done by then), not from the save of iteration 4; the one of 4 from the boundary after 5.
    Each poll here first waits for the write in flight, so the counts do not depend on the disk's speed."""
    from concurrent.futures import wait

    from jagg.ops.checkpoint import CheckpointWriter, read_progress

    run, seen, real = tmp_path / "run", [], CheckpointWriter.poll

    def poll(self):
        if self.pending is not None:
            wait([self.pending.written])
        finished = real(self)
        seen.append((_iterations_logged(run)[-1], finished and read_progress(finished)["iteration"]))
        return finished

    monkeypatch.setattr(CheckpointWriter, "poll", poll)
    every = ["train.iterations=5", "log.checkpoint_every=2", "log.async_checkpoint=true"]
    assert main(_cli(tmp_path, *every)) == 0
    assert seen == [(1, None), (2, None), (3, 2), (4, None), (5, 4)]
    assert read_progress(run / "checkpoint")["iteration"] == 5  # the end of fit saves and finishes the last


POLL_DRILL = (  # jagg.train whose polls wait for the write in flight until sys.argv[1] exists; write number
    # int(sys.argv[2]) hangs (a slow disk; 0: none) and the rollout of iteration int(sys.argv[3]) + 1 hangs (-1:
    # none), each creating sys.argv[1] first, until killed
    "import sys, time\nfrom concurrent.futures import wait\nfrom pathlib import Path\n"
    "from torch.distributed.checkpoint.filesystem import FileSystemWriter\nimport jagg.loop.rollout as rollout\n"
    "from jagg.ops.checkpoint import CheckpointWriter\nfrom jagg.train import main\n"
    "marker, hang_write, hang_rollout = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])\n"
    "writes, real_write, real_poll, real_call = [], FileSystemWriter.write_data, CheckpointWriter.poll, "
    "rollout.Sampler.__call__\n"
    "def hang():\n    marker.write_text('hanging')\n    time.sleep(600)\n"
    "def write_data(self, plan, planner):\n"
    "    writes.append(1)\n"
    "    if len(writes) == hang_write:\n        hang()\n"
    "    return real_write(self, plan, planner)\n"
    "def poll(self):\n"
    "    if self.pending is not None and not marker.exists():\n        wait([self.pending.written])\n"
    "    return real_poll(self)\n"
    "def call(self, it, *args, **kw):\n"
    "    if it == hang_rollout:\n        hang()\n"
    "    return real_call(self, it, *args, **kw)\n"
    "FileSystemWriter.write_data, CheckpointWriter.poll, rollout.Sampler.__call__ = write_data, poll, call\n"
    "sys.exit(main(sys.argv[4:]))\n"
)


@pytest.mark.parametrize("case", ["write_in_flight", "between_saves"])
def test_kill_9_after_an_async_save_was_finished_at_a_boundary(tmp_path, case):
    """log.checkpoint_every=2, asynchronous: the save of iteration 2 is finished at the boundary after iteration
    3. ``write_in_flight``: the save of iteration 4 never finishes writing; kill -9 once iteration 5 is logged.
    ``between_saves``: kill -9 in iteration 4's rollout, no write in flight. Either way checkpoint/ is iteration
    2's, with its manifest, nothing needs promoting (before the change, ``between_saves`` left the complete save
    in checkpoint.tmp/ and no checkpoint), and --resume auto ends bitwise where an uninterrupted run ends."""
    from jagg.distributed import DistInfo
    from jagg.ops.checkpoint import find_checkpoint, read_progress, verify_checkpoint

    run, marker = tmp_path / "run", tmp_path / "hanging"
    iterations = 6 if case == "write_in_flight" else 4
    every = [f"train.iterations={iterations}", "log.checkpoint_every=2", "log.async_checkpoint=true"]
    # the rollout after the last logged iteration stalls too, so the kill finds exactly `logged_at_kill` (else
    # a fast iteration 6 can be logged between two polls, and the condition never holds)
    hang = ["2", "5"] if case == "write_in_flight" else ["0", "3"]
    logged_at_kill = [1, 2, 3, 4, 5] if case == "write_in_flight" else [1, 2, 3]
    _kill_9_when(
        tmp_path,
        POLL_DRILL,
        [str(marker), *hang, *_cli(tmp_path, *every)],
        lambda: marker.exists() and _iterations_logged(run) == logged_at_kill,
    )
    assert find_checkpoint(run) == run / "checkpoint" and read_progress(run / "checkpoint")["iteration"] == 2
    verify_checkpoint(run / "checkpoint", DistInfo())  # its manifest was written at the boundary
    in_flight = run / "checkpoint.tmp"
    assert in_flight.is_dir() == (case == "write_in_flight") and not (in_flight / ".metadata").exists()
    assert main(_cli(tmp_path, "--resume=auto", *every)) == 0
    (resume,) = json.loads((run / "run.json").read_text())["resumes"]
    assert resume["promoted_checkpoint_tmp"] is None
    assert resume["metrics_rows_dropped"] == len(logged_at_kill) - 2
    _equals_uninterrupted(run, tmp_path, f"train.iterations={iterations}", "log.checkpoint_every=2")


FILE_SIZE_LIMIT = (  # jagg.train under a file-size limit of int(sys.argv[1]) bytes, SIGXFSZ ignored (so a
    # write past it fails with EFBIG instead of killing the process)
    "import resource, signal, sys\nfrom jagg.train import main\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    "hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), hard))\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_checkpoint_past_the_file_size_limit_is_one_line_exit_2(tmp_path, mode):
    """Issue 41: a shard write past ``ulimit -f`` was a 40-line DCP traceback (torch's zip writer loses the
    errno). Now one line naming the shard and EFBIG, exit 2, checkpoint.tmp/ removed, sync and async (the
    asynchronous save's failure is reported at the boundary after the next iteration)."""
    run = tmp_path / "run"
    flags = [
        "train.iterations=2",
        "log.checkpoint_every=1",
        f"log.async_checkpoint={str(mode == 'async').lower()}",
    ]
    done = _cli_process(tmp_path, FILE_SIZE_LIMIT, str(2**20), *_cli(tmp_path, *flags))  # the shard: ~16 MiB
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip()
    shard = run / "checkpoint.tmp" / "__0_0.distcp"
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"writing checkpoint {run / 'checkpoint'} failed: {shard}: File too large (EFBIG)" in err, err
    assert "1.0 MiB" in err and "--resume" in err, err
    assert not (run / "checkpoint.tmp").exists() and not (run / "checkpoint").exists()
    assert _iterations_logged(run) == ([1] if mode == "sync" else [1, 2])
