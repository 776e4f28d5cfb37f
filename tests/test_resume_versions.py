"""Run directories written by earlier versions resume with the current code (issue 57, issue 58's retry loop).

The run directories under tests/golden/old_runs/ were written by the CLI of earlier commits
(tests/golden/old_runs.py says how), one iteration each, and are committed as they came out:

    v0764738_before_landing         the commit before the last wave (dc9c131^): no algorithm.exact_steps,
                                    log.eval_at, log.landing, model.base_dtype, optim.ema_*, ... (keys added since)
    ve882fca_before_plugin_config   the commit before the plug-in config (e882fca), with the controls' and the
                                    instruments' keys set away from their defaults under their old names
                                    (train.control_*, log.fidelity_every, log.landing)

A resume compares the config with run.json's and the checkpoint's own as the current code reads them
(``jagg.config.stored_config``): a key added since reads as its default, a renamed key as its new name, a
removed key as absent when it holds the value the code now behaves as; only a value that really changed is
refused, and ``--allow-config-change KEY ...`` allows exactly the keys named.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from jagg import config as config_module
from jagg.config import RENAMED_KEYS, load_config, stored_config
from jagg.errors import ConfigError
from jagg.ops import preflight
from jagg.ops.rundir import REPO_ROOT as ROOT
from jagg.train import main

sys.path.insert(0, str(ROOT / "tests" / "golden"))
import trainer_runs  # noqa: E402

OLD_RUNS = ROOT / "tests" / "golden" / "old_runs"
PREWAVE, PLUGIN_KEYS = "v0764738_before_landing", "ve882fca_before_plugin_config"


def _old_overrides(name: str) -> list[str]:
    """The overrides the old run was started with (its run.json's argv), without its log.run_dir."""
    argv = json.loads((OLD_RUNS / name / "run.json").read_text())["argv"]
    return [a for a in argv[1:] if "=" in a and not a.startswith(("-", "log.run_dir="))]


def _copy(name: str, tmp_path: Path) -> Path:
    run = tmp_path / name
    shutil.copytree(OLD_RUNS / name, run)
    return run


def _cli(run: Path, overrides: list[str], *extra: str) -> list[str]:
    return ["--config", "configs/world/flux_dancegrpo.yaml", *overrides, f"log.run_dir={run}", *extra]


def _exit(args: list[str]) -> int:
    try:
        return main(args)
    except SystemExit as exc:
        return exc.code


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", [PREWAVE, PLUGIN_KEYS])
@pytest.mark.parametrize("record", ["run.json", "checkpoint only"])
def test_an_old_run_compares_equal_where_nothing_changed(tmp_path, name, record):
    """Every key the old run lacks reads as its default, every renamed key as its new name: the old run's
    own overrides give no change but where it now lives (log.run_dir, resumable)."""
    run = _copy(name, tmp_path)
    if record == "checkpoint only":
        (run / "run.json").unlink()
    cfg = load_config("configs/world/flux_dancegrpo.yaml", [*_old_overrides(name), f"log.run_dir={run}"])
    start = preflight.start_run_dir(cfg, "required", overwrite=False)
    assert start.resume and set(start.changes) == {"log.run_dir"}  # moved: the fixture was written elsewhere


def test_the_old_config_reads_every_key_added_since_as_its_default():
    """The stored config of the commit before the last wave lacks keys that exist now; read by the current
    code it holds all of them, at their defaults, and the stored values as stored."""
    stored = json.loads((OLD_RUNS / PREWAVE / "run.json").read_text())["config"]
    read = stored_config(stored)
    defaults = config_module.json_safe(config_module.Config().to_dict())
    for section in ("model", "optim", "log", "algorithm"):
        added = set(defaults[section]) - set(stored[section])
        assert added, section  # the fixture is older than these keys
        assert {k: read[section][k] for k in added} == {k: defaults[section][k] for k in added}
        kept = {k: v for k, v in stored[section].items() if f"{section}.{k}" not in RENAMED_KEYS}
        assert {k: read[section][k] for k in kept} == kept
    # renamed: the stored value under the new name (the fixture's log.fidelity_every, train.control_cosine)
    assert read["plugins"]["fidelity"]["every"] == stored["log"]["fidelity_every"]
    assert read["plugins"]["control"]["cosine"] == stored["train"]["control_cosine"]


def test_a_removed_key_reads_as_absent_only_at_the_value_the_code_now_has(monkeypatch):
    """REMOVED_KEYS: a stored value equal to what the code now always does is no change; another one is."""
    stored = json.loads((OLD_RUNS / PLUGIN_KEYS / "run.json").read_text())["config"]
    assert stored["log"]["landing"] is True  # read as plugins.landing.enabled (renamed)
    new = config_module.json_safe(config_module.Config().to_dict())
    monkeypatch.setattr(config_module, "REMOVED_KEYS", {"plugins.landing.enabled": True})
    assert "plugins.landing.enabled" not in preflight.config_changes(stored_config(stored), new)
    monkeypatch.setattr(config_module, "REMOVED_KEYS", {"plugins.landing.enabled": False})
    changes = preflight.config_changes(stored_config(stored), new)
    assert changes["plugins.landing.enabled"] == (True, False)


@pytest.mark.parametrize("name", [PREWAVE, PLUGIN_KEYS])
def test_an_old_run_resumes_and_continues_as_an_uninterrupted_run(tmp_path, name):
    """Resumed by the CLI with its own overrides, no flag: iteration 2 is the one a fresh run of today's code
    trains after iteration 1 (the same numbers), and run.json records no config change but the length."""
    run = _copy(name, tmp_path)
    overrides = _old_overrides(name)
    assert main(_cli(run, overrides, "train.iterations=2", "--resume")) == 0
    fresh = tmp_path / "fresh"
    assert main(_cli(fresh, overrides, "train.iterations=2")) == 0
    resumed, uninterrupted = ([trainer_runs.strip(r) for r in _rows(d)] for d in (run, fresh))
    assert [r["iteration"] for r in resumed] == [1, 2]
    assert json.dumps(resumed, sort_keys=True) == json.dumps(uninterrupted, sort_keys=True)
    changes = json.loads((run / "run.json").read_text())["resumes"][0]["config_changes"]
    assert set(changes) == {"log.run_dir", "train.iterations"}


def test_a_real_change_is_refused_and_allowed_only_by_name(tmp_path, capsys):
    """optim.lr and train.seed changed: refused, naming both; --allow-config-change optim.lr still refuses
    train.seed (the one-switch flag accepted both); naming both resumes. Nothing is written by a refusal."""
    run = _copy(PREWAVE, tmp_path)
    cli = _cli(
        run, _old_overrides(PREWAVE), "train.iterations=2", "optim.lr=0.001", "train.seed=7", "--resume"
    )
    before = _tree(run)
    capsys.readouterr()
    assert _exit(cli) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "optim.lr: 0.0001 -> 0.001" in err and "train.seed: 0 -> 7" in err
    assert "--allow-config-change optim.lr train.seed" in err and "exact_steps" not in err, err
    assert _exit([*cli, "--allow-config-change", "optim.lr"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.seed: 0 -> 7" in err and "optim.lr:" not in err, err
    assert _tree(run) == before
    assert main([*cli, "--allow-config-change", "optim.lr", "train.seed"]) == 0
    changes = json.loads((run / "run.json").read_text())["resumes"][0]["config_changes"]
    assert changes["optim.lr"] == [0.0001, 0.001] and changes["train.seed"] == [0, 7]


@pytest.mark.parametrize("names", [[], ["optim.lrr"]])
def test_allow_config_change_names_real_keys(tmp_path, capsys, names):
    run = _copy(PREWAVE, tmp_path)
    capsys.readouterr()
    assert _exit(_cli(run, _old_overrides(PREWAVE), "--resume", "--allow-config-change", *names)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--allow-config-change" in err, err
    assert "did you mean 'optim.lr'" in err if names else "names the keys" in err


def test_allowed_keys_read_renamed_names():
    assert preflight.allowed_keys(["backward.endpoints", "optim.lr"]) == {"backward.graph_mode", "optim.lr"}
    with pytest.raises(ConfigError, match="not a config key"):
        preflight.allowed_keys(["optim"])


def test_the_retry_loop_continues_after_an_allowed_change(tmp_path, capsys):
    """Issue 58: after a resume with an allowed change, run.json and the checkpoint agree on the new values, so
    ``--resume auto`` with them continues; also when the resume stopped before its next save (the checkpoint
    still has the old value). Going back to the old value is a change again."""
    run = _copy(PREWAVE, tmp_path)
    base = _cli(run, _old_overrides(PREWAVE), "optim.lr=0.5")
    assert main([*base, "train.iterations=2", "--resume", "--allow-config-change", "optim.lr"]) == 0
    assert main([*base, "train.iterations=3", "--resume", "auto"]) == 0
    assert [r["iteration"] for r in _rows(run)] == [1, 2, 3]
    assert [r["lr"] for r in _rows(run)] == [0.0001, 0.5, 0.5]
    # as if the allowed resume had stopped before its first save: run.json has the change, the checkpoint not
    shutil.rmtree(run / "checkpoint")
    shutil.copytree(OLD_RUNS / PREWAVE / "checkpoint", run / "checkpoint")
    assert main([*base, "train.iterations=2", "--resume", "auto"]) == 0
    capsys.readouterr()
    old_lr = [a for a in base if not a.startswith("optim.lr")]
    assert _exit([*old_lr, "train.iterations=3", "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert "optim.lr: 0.5 -> 0.0001" in err and "run.json" in err, err


@pytest.mark.parametrize("case", ["groups_auto", "knots_auto", "windows_auto"])
def test_the_committed_old_checkpoints_compare_equal(tmp_path, case):
    """tests/golden/checkpoints (no run.json: the checkpoint's own config, written before the plug-in refactor)
    resumed with the config they were written with: no change but where they live (refused before)."""
    import old_checkpoints

    from helpers import tiny_config

    config, extra = trainer_runs.cases()[case]
    run = tmp_path / case
    shutil.copytree(old_checkpoints.HERE / "checkpoints" / case, run)
    cfg = tiny_config(
        run,
        *trainer_runs.GOLDEN_RUN,
        *extra,
        *old_checkpoints.LORA,
        "log.checkpoint_every=2",  # as old_checkpoints.py wrote them
        config=f"configs/world/{config}",
    )
    assert set(preflight.start_run_dir(cfg, "required", overwrite=False).changes) <= {"log.run_dir"}
