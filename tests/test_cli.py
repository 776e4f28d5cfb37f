"""``python -m jagg.train``: config errors exit 2 with one line naming the key, before anything is written;
overrides anywhere, resume modes and run.json on resume."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jagg.config import TINY_RUN, load_config
from jagg.train import main, split_overrides

TINY = [*TINY_RUN, "sampling.num_steps=4"]


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("backward.jagg_frac=1.5", "backward.jagg_frac must be in [0, 1]"),
        ("backward.group_size=1", "backward.group_size must be an integer >= 2"),
        ("algorithm.clip_range=0", "algorithm.clip_range must be > 0"),
        ("algorithm.clip_range=-1e-4", "algorithm.clip_range must be > 0"),
        ("backward.strategy=fast", "backward.strategy must be one of"),
        ("backward.bogus=1", "unknown key backward.bogus"),
        ("train.iterations=ten", "train.iterations: expected int"),
        ("train.iterations=2.5", "train.iterations: expected int"),
        ("model.gradient_checkpointing=3", "model.gradient_checkpointing: expected bool"),
        ("algorithm.name=ppo", "algorithm.name must be one of"),
        ("reward.weights={hps: 1.0}", "reward.weights: unknown reward 'hps'"),
        ("optim.lr=.inf", "optim.lr must be a finite number, got inf"),
        ("optim.lr=nan", "optim.lr must be a finite number, got 'nan'"),
        ("optim.weight_decay=-.inf", "optim.weight_decay must be a finite number"),
        ("train.seed=100000000000000", "train.seed must be in [0, 4294967295]"),
        ("train.seed=-1", "train.seed must be in [0, 4294967295]"),
    ],
)
def test_bad_values_exit_2_and_write_nothing(tmp_path, capsys, override, names):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["--config", "configs/world/flux_dancegrpo.yaml", *TINY, f"log.run_dir={run_dir}", override])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err
    assert not run_dir.exists()


def test_window_outside_schedule(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--config",
                "configs/world/flux_flowgrpo_fast.yaml",
                *TINY,
                f"log.run_dir={tmp_path / 'r'}",
                "algorithm.sde_window_range=[2, 9]",
            ]
        )
    assert exc.value.code == 2
    assert "algorithm.sde_window_range" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_missing_config_and_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(tmp_path / "nope.yaml")])
    assert exc.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "--config",
                "configs/world/flux_dancegrpo.yaml",
                *TINY,
                f"log.run_dir={tmp_path / 'r'}",
                "--resume",
            ]
        )
    assert exc.value.code == 2 and "missing checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_inheritance_differs_only_where_declared():
    base, qwen = (
        load_config("configs/world/flux_dancegrpo.yaml"),
        load_config("configs/world/qwenimage_dancegrpo.yaml"),
    )
    a, b = base.to_dict(), qwen.to_dict()
    diff = {(s, k) for s in a for k in a[s] if a[s][k] != b[s][k]}
    assert diff == {("model", "backbone"), ("log", "run_dir")}


def test_cli_end_to_end_subprocess(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "jagg.train",
        "--config",
        "configs/world/flux_dancegrpo.yaml",
        *TINY,
        f"log.run_dir={run_dir}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    meta = json.loads((run_dir / "run.json").read_text())
    assert {"git_sha", "hardware", "versions", "config", "seed"} <= set(meta)
    assert meta["config"]["backward"]["strategy"] == "jagg"
    assert (run_dir / "checkpoint" / ".metadata").is_file()  # sharded (DCP) checkpoint directory
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 2 and "already exists" in again.stderr


# --------------------------------------------------------------------------- issue 22: the CLI as a newcomer meets it
WORLD = "configs/world/flux_dancegrpo.yaml"


def test_run_json_names_the_world_build_a_world_run_loads(tmp_path, monkeypatch):
    """The world's pretraining is bitwise reproducible per machine only: run.json says which build ran."""
    from jagg.ops.preflight import RunStart
    from jagg.train import _write_run_json

    monkeypatch.setenv("JAGG_WORLD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "flux.json").write_text(json.dumps({"sha256": "ab" * 32}))
    fresh = RunStart(resume=False, wipe=False)
    for source, build in (("world", {"flux": "ab" * 8}), ("tiny", None)):
        (tmp_path / source).mkdir()
        _write_run_json(load_config(WORLD, [f"model.source={source}"]), tmp_path / source, fresh, [], 1)
        assert json.loads((tmp_path / source / "run.json").read_text()).get("world_build") == build


def _fails(capsys, argv: list[str]) -> str:
    """Run the CLI expecting exit 2 with one line on stderr; return that line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_overrides_anywhere_on_the_line(capsys):
    assert split_overrides(
        ["--resume", "a.b=1", "--world-size", "2", "c.d=[1, 2]", "--config", "x=y.yaml"]
    ) == (
        ["--resume", "--world-size", "2", "--config", "x=y.yaml"],
        ["a.b=1", "c.d=[1, 2]"],
    )
    argv = [
        "--world-size",
        "2",
        "backward.strategy=exact",
        "--config",
        WORLD,
        "--dry-run",
        "train.grad_accum=1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "plan for world size 2" in out and "strategy exact" in out.lower().replace("=", " ")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("backward: {strategy: exact]\n", "YAML syntax error at line 2, column 27"),
        ("train:\n\titerations: 2\n", "YAML syntax error at line 3, column 1"),
    ],
)
def test_yaml_syntax_error_is_one_line_exit_2(tmp_path, capsys, text, where):
    path = tmp_path / "bad.yaml"
    path.write_text(f"inherit: {Path(WORLD).resolve().parent / 'base.yaml'}\n{text}")
    err = _fails(capsys, ["--config", str(path)])
    assert str(path) in err and where in err
    err = _fails(capsys, ["--config", WORLD, "train.iterations=[1,"])
    assert "override 'train.iterations=[1,': YAML syntax error" in err


def test_config_is_required(capsys):
    assert "--config is required" in _fails(capsys, ["train.iterations=2"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("backward.group_size=3.5", "backward.group_size must be an integer >= 2 or 'auto', got 3.5"),
        ("data.train_limit=ten", "data.train_limit: expected int or null, got 'ten'"),
        ("backward.group_sizes=[2, x]", "backward.group_sizes[1]: expected int, got 'x'"),
    ],
)
def test_type_names_in_messages(capsys, override, expected):
    err = _fails(capsys, ["--config", WORLD, override, "--dry-run"])
    assert expected in err and "expected str," not in err


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("backward.stratgy=exact", "unknown key backward.stratgy (did you mean backward.strategy?)"),
        ("bakward.strategy=exact", "unknown key bakward (did you mean backward?)"),
        ("reward.eval=[prefs]", "reward.eval: unknown reward 'prefs' (did you mean 'pref'?)"),
        ("train.iteration=3", "did you mean train.iterations?"),
    ],
)
def test_did_you_mean(capsys, override, hint):
    assert hint in _fails(capsys, ["--config", WORLD, override])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_fails_before_writing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    err = _fails(capsys, ["--config", WORLD, *TINY, f"log.run_dir={run_dir}", "train.device=cuda"])
    assert "train.device=cuda, but no CUDA device is available" in err
    assert not run_dir.exists()


def test_prompt_set_typo_fails_before_the_model_code(tmp_path):
    """A typo'd prompt set is reported before diffusers / the world are imported and before anything is written
    (a fresh interpreter, so the test sees what the CLI imported)."""
    run_dir = tmp_path / "run"
    code = (
        "import sys\nfrom jagg.train import main\n"
        f"try:\n    main(['--config', 'configs/paper/flux_dancegrpo.yaml', 'log.run_dir={run_dir}',"
        " 'data.train_prompts=hpdv2_trian'])\nexcept SystemExit as e:\n    print('exit', e.code)\n"
        "print('heavy', sorted(m for m in ('diffusers', 'transformers', 'open_clip', 'jagg.world') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "exit 2" in out.stdout and "heavy []" in out.stdout, out.stdout + out.stderr
    assert "data.train_prompts: 'hpdv2_trian' is neither a file nor a prompt set" in out.stderr
    assert "did you mean 'hpdv2_train'?" in out.stderr
    assert not run_dir.exists()


def test_missing_flow_grpo_split_fails_offline_before_the_model_code(tmp_path):
    """The SD3.5-M recipe's named caption split, absent and offline: one line saying how to provide it, exit 2,
    before diffusers is imported and before anything is written; a dry run does not look for it."""
    run_dir = tmp_path / "run"
    config = "configs/paper/sd3/sd35m_flowgrpo.yaml"
    code = (
        "import sys\nfrom jagg.train import main\n"
        f"try:\n    main(['--config', '{config}', 'log.run_dir={run_dir}'])\nexcept SystemExit as e:\n"
        "    print('exit', e.code)\n"
        "print('heavy', sorted(m for m in ('diffusers', 'transformers', 'open_clip', 'jagg.world') if m in sys.modules))"
    )
    env = {**os.environ, "JAGG_PROMPTS_DIR": str(tmp_path / "prompts"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "exit 2" in out.stdout and "heavy []" in out.stdout, out.stdout + out.stderr
    where = "yifan123/flow_grpo@ac4c86e:dataset/pickscore/train.txt"
    assert f"data.train_prompts: prompt dataset 'pickscore_flowgrpo_train': {where}" in out.stderr
    assert not run_dir.exists() and not (tmp_path / "prompts").exists()


def test_preflight_reward_names_equal_the_registry():
    from jagg.loop.rewards import REWARD_DTYPES, REWARDS
    from jagg.ops import preflight

    assert sorted(preflight.REWARD_NAMES) == sorted(REWARDS)
    assert sorted(preflight.REWARD_DTYPE_NAMES) == sorted(REWARD_DTYPES)


def test_resume_with_overwrite_refused(tmp_path, capsys):
    for resume in (["--resume"], ["--resume", "auto"]):
        err = _fails(
            capsys, ["--config", WORLD, *TINY, f"log.run_dir={tmp_path / 'r'}", *resume, "--overwrite"]
        )
        assert "--resume and --overwrite contradict each other" in err


def _meta(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_compares_config_and_keeps_run_json(tmp_path, capsys):
    run_dir = tmp_path / "run"
    cli = ["--config", WORLD, *TINY, f"log.run_dir={run_dir}"]
    assert main(cli) == 0
    first = _meta(run_dir)
    err = _fails(capsys, [*cli, "--resume", "backward.strategy=exact", "optim.lr=0.001"])
    assert "differs from" in err and "backward.strategy: 'jagg' -> 'exact'" in err and "optim.lr" in err
    assert _meta(run_dir) == first
    # a longer run, or checkpoints written in the background from now on, needs no flag
    assert main([*cli, "--resume", "train.iterations=2", "log.async_checkpoint=true"]) == 0
    assert [r["iteration"] for r in _rows(run_dir)] == [1, 2]
    assert (
        main([*cli, "train.iterations=3", "--resume", "--allow-config-change", "optim.lr", "optim.lr=0.001"])
        == 0
    )
    meta = _meta(run_dir)
    assert {k: meta[k] for k in first} == first  # config, SHA, argv of the first run kept
    assert meta["config"]["optim"]["lr"] == first["config"]["optim"]["lr"]
    # each resume records what changed from the config the run trained with just before it (run.json's first
    # config with the earlier resumes' changes applied), so the second undoes the first's async_checkpoint
    assert [r["config_changes"] for r in meta["resumes"]] == [
        {"log.async_checkpoint": ["auto", True], "train.iterations": [1, 2]},
        {
            "log.async_checkpoint": [True, "auto"],
            "optim.lr": [first["config"]["optim"]["lr"], 0.001],
            "train.iterations": [2, 3],
        },
    ]
    assert [r["iteration"] for r in _rows(run_dir)] == [1, 2, 3]


def test_resume_auto_starts_fresh_only_where_nothing_is_lost(tmp_path, capsys):
    run_dir = tmp_path / "run"
    cli = ["--config", WORLD, *TINY, f"log.run_dir={run_dir}", "--resume", "auto"]
    assert main(cli) == 0  # nothing there yet: a fresh run
    assert len(_rows(run_dir)) == 1 and "resumes" not in _meta(run_dir)
    assert main([*cli, "train.iterations=2"]) == 0  # a checkpoint now: resumed
    assert [r["iteration"] for r in _rows(run_dir)] == [1, 2] and len(_meta(run_dir)["resumes"]) == 1
    shutil.rmtree(
        run_dir / "checkpoint"
    )  # no checkpoint: its rows are past it, dropped and redone (issue 41)
    assert main(cli) == 0
    assert len(_rows(run_dir)) == 1 and "resumes" not in _meta(run_dir)
    assert [r["metrics_rows_dropped"] for r in _meta(run_dir)["restarts"]] == [2]
    shutil.rmtree(run_dir / "checkpoint")
    (run_dir / "metrics.jsonl").unlink()  # preempted before its first row: run.json only, nothing to lose
    assert main(cli) == 0
    assert len(_rows(run_dir)) == 1 and "resumes" not in _meta(run_dir)
    assert [r["metrics_rows_dropped"] for r in _meta(run_dir)["restarts"]] == [2, 0]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("someone else's directory")
    assert "is not a run directory" in _fails(capsys, [*cli, f"log.run_dir={other}"])
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


# --------------------------------------------------------------------------- renamed keys keep loading
def test_renamed_keys_load_as_their_new_names(tmp_path, capsys):
    """backward.endpoints and backward.reuse_rollout, the old names of backward.graph_mode and
    backward.stored_outputs, mean the same in a file, in an inheriting file and on the command line; one file
    giving both names is an error naming them."""
    new = load_config(WORLD, ["backward.graph_mode=joint", "backward.stored_outputs=false"])
    old_file = tmp_path / "old.yaml"
    old_file.write_text(
        f"inherit: {Path(WORLD).resolve()}\nbackward: {{endpoints: joint, reuse_rollout: false}}\n"
    )
    assert load_config(old_file) == new
    assert load_config(WORLD, ["backward.endpoints=joint", "backward.reuse_rollout=false"]) == new
    assert load_config(old_file).backward.graph_mode == "joint" and not new.backward.stored_outputs
    child = tmp_path / "child.yaml"  # a new key in a file over an old one in its parent: the child wins
    child.write_text("inherit: old.yaml\nbackward: {graph_mode: sequential}\n")
    assert load_config(child).backward.graph_mode == "sequential"
    assert load_config(old_file, ["backward.graph_mode=sequential"]) == load_config(child)
    both = tmp_path / "both.yaml"
    both.write_text("backward: {endpoints: joint, graph_mode: joint}\n")
    err = _fails(capsys, ["--config", str(both), f"log.run_dir={tmp_path / 'run'}"])
    assert "backward.endpoints is the old name of backward.graph_mode" in err


def test_resume_reads_a_run_json_written_under_the_old_key_names(tmp_path, capsys):
    """A run started before the rename stored backward.endpoints / backward.reuse_rollout in run.json: resuming
    it with the same config is no config change, and a real change is still refused under the new name."""
    run_dir = tmp_path / "run"
    cli = ["--config", WORLD, *TINY, f"log.run_dir={run_dir}"]
    assert main(cli) == 0
    meta = _meta(run_dir)
    backward = meta["config"]["backward"]
    backward["endpoints"], backward["reuse_rollout"] = (
        backward.pop("graph_mode"),
        backward.pop("stored_outputs"),
    )
    (run_dir / "run.json").write_text(json.dumps(meta))
    assert main([*cli, "--resume", "train.iterations=2"]) == 0
    assert _meta(run_dir)["resumes"][0]["config_changes"] == {"train.iterations": [1, 2]}
    err = _fails(capsys, [*cli, "--resume", "train.iterations=3", "backward.graph_mode=joint"])
    assert "backward.graph_mode: 'batched' -> 'joint'" in err and "endpoints" not in err


# --------------------------------------------------------------------------- issue 29: inputs checked before anything runs
def test_inherit_cycle_is_one_line(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("inherit: b.yaml\ntrain: {iterations: 2}\n")
    (tmp_path / "b.yaml").write_text("inherit: a.yaml\n")
    err = _fails(capsys, ["--config", str(tmp_path / "a.yaml"), f"log.run_dir={tmp_path / 'run'}"])
    assert f"inherit: cycle {tmp_path / 'a.yaml'} -> {tmp_path / 'b.yaml'} -> {tmp_path / 'a.yaml'}" in err
    assert not (tmp_path / "run").exists()


def test_empty_or_blank_prompt_file_fails_before_the_model_code(tmp_path):
    """Read before any weight loads (minutes at paper scale); a fresh interpreter shows what was imported."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\t\n")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a cat"\n')
    code = "import sys\nfrom jagg.train import main\n"
    for name in ("empty.txt", "blank.txt", "broken.jsonl"):
        code += (
            f"try:\n    main(['--config', 'configs/paper/flux_dancegrpo.yaml', 'log.run_dir={tmp_path / 'run'}',"
            f" 'data.eval_prompts={tmp_path / name}'])\nexcept SystemExit as e:\n    print('exit', e.code)\n"
        )
    code += (
        "print('heavy', sorted(m for m in ('diffusers', 'transformers', 'open_clip') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.count("exit 2") == 3 and "heavy []" in out.stdout, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 3, out.stderr
    assert f"data.eval_prompts: prompt file {tmp_path / 'empty.txt'} holds no prompt" in lines[0]
    assert f"data.eval_prompts: prompt file {tmp_path / 'blank.txt'} holds no prompt" in lines[1]
    assert f"data.eval_prompts: prompt file {tmp_path / 'broken.jsonl'} cannot be read" in lines[2]
    assert not (tmp_path / "run").exists()


def test_dry_run_prints_no_misleading_warning():
    """open_clip's "No pretrained weights loaded ... initialized randomly" (the plan builds HPSv2's
    architecture on the meta device) is not shown, and no line is printed twice."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "jagg.train", "--config", "configs/paper/flux_dancegrpo.yaml", "--dry-run"]
    out = subprocess.run([*cmd, "--world-size", "8"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "memory per rank" in out.stdout
    assert out.stderr == "", out.stderr
