"""The plug-in surface of the loop (jagg.plugins.base): a new instrument is one class and one entry of
``PLUGINS``; the trainer calls its touch points in order, puts its metrics in the row and keeps its state in
checkpoints. The built-in plug-ins are tested where their measurements are (test_fidelity, test_control)."""

from __future__ import annotations

import json

import pytest
import torch

import jagg.plugins
from helpers import build_trainer
from jagg.plugins import PLUGINS, build_plugins
from jagg.plugins.base import Plugin


class Recorder(Plugin):
    """Records every touch point, and counts optimizer steps across the run (its state)."""

    name = "recorder"
    calls: list = []  # shared by every instance of one test, so the resumed trainer's calls are seen too

    def __init__(self) -> None:
        self.steps = 0

    @classmethod
    def from_config(cls, cfg, run):
        return cls()

    def begin_update(self, view):
        self.calls.append(("begin", view.iteration, len(view.micro_batches)))

    def before_step(self, view, pending):
        grads = [p.grad for p in view.params if p.grad is not None]
        self.calls.append(("step", [b.rows for b in pending], bool(grads), len(pending[0].stats)))
        self.steps += 1

    def metrics(self):
        return {"recorder_steps": self.steps}

    def after_evaluation(self, it, images, weights):
        self.calls.append(("evaluated", it, images.shape[0], len(weights)))

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state.get("steps", 0)


def test_a_new_plugin_is_one_registry_entry(tiny_cfg, monkeypatch, tmp_path):
    """Two micro-batches of 3 and an optimizer step after each (the loop tests' run), 2 iterations, evaluation
    at 0 and 2, a checkpoint at 1: the touch points come in order with the gradient in place, the metrics reach
    the row, and the state survives a resume (the resumed run counts on from the checkpoint's steps)."""
    monkeypatch.setattr(jagg.plugins, "PLUGINS", (*PLUGINS, Recorder))
    Recorder.calls = []
    cfg = tiny_cfg("log.eval_every=2", "log.checkpoint_every=1")
    trainer = build_trainer(cfg)
    assert [p.name for p in trainer.plugins][-1] == "recorder"
    rows = trainer.fit()
    calls = Recorder.calls
    assert calls[0][0] == "evaluated" and calls[0][1] == 0
    update = [c for c in calls if c[0] != "evaluated"]
    assert update[0] == ("begin", 0, 2)
    assert update[1] == ("step", [slice(0, 3)], True, 3) and update[2] == ("step", [slice(3, 6)], True, 3)
    assert update[3] == ("begin", 1, 2) and calls[-1][:2] == ("evaluated", 2)
    assert [r["recorder_steps"] for r in rows if "recorder_steps" in r] == [2, 4]
    progress = torch.load(tmp_path / "checkpoint" / "progress.pt", weights_only=False)
    assert progress["plugins"]["recorder"] == {"steps": 4}
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["recorder_steps"] == 4

    resumed = build_trainer(tiny_cfg("log.eval_every=2", "log.checkpoint_every=1", "train.iterations=3"))
    resumed.load_checkpoint()
    assert resumed.plugin("recorder").steps == 4
    assert resumed.fit()[-1]["recorder_steps"] == 6


def test_plugins_act_in_registry_order_control_before_fidelity(tiny_cfg):
    """The control degrades the gradient before fidelity measures it (so a control arm's fidelity is its cosine)."""
    from jagg.distributed import DistInfo
    from jagg.plugins.base import RunView

    cfg = tiny_cfg("train.control_cosine=0.5", "log.fidelity_every=1")
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.AdamW(params)
    run = RunView(params, 0, cfg.log.run_dir, DistInfo.current(), torch.device("cpu"), optimizer)
    names = [p.name for p in build_plugins(cfg, run)]
    # eval_state off; on-policy and peak memory always on
    assert names == ["control", "fidelity", "onpolicy", "peak_memory"]


class Counter(Plugin):
    """Counts optimizer steps (its state); appended by hand, not built from the registry."""

    name = "counter"

    def __init__(self) -> None:
        self.steps = 0

    def before_step(self, view, pending):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state.get("steps", 0)


def test_a_plugin_appended_after_construction_is_checkpointed(tiny_cfg, tmp_path):
    """The trainer's one list: a plug-in a driver appends after construction (as ``experiments/landing.py``
    appends its gradient tap) acts, and its state goes into the checkpoint and comes back on resume; two
    plug-ins of one name would share one state, so a save refuses them."""
    trainer = build_trainer(tiny_cfg("train.iterations=1"))
    trainer.plugins.append(Counter())
    trainer.fit()
    progress = torch.load(tmp_path / "checkpoint" / "progress.pt", weights_only=False)
    assert progress["plugins"]["counter"] == {"steps": 2}  # two micro-batches, a step after each
    resumed = build_trainer(tiny_cfg("train.iterations=1"))
    resumed.plugins.append(Counter())
    resumed.load_checkpoint()
    assert resumed.plugin("counter").steps == 2
    resumed.plugins.append(Counter())
    with pytest.raises(ValueError, match="two plug-ins share a name"):
        resumed.save_checkpoint()


def test_a_checkpoint_from_before_plugins_were_named_so_keeps_their_state():
    """progress.pt files written before the rename hold the plug-ins' state as ``components`` (the pre-rename
    fixtures of the resume tests have them); both read as the plug-ins' state, the newer name first."""
    from jagg.ops.checkpoint import legacy_plugins

    state = {"recorder": {"steps": 4}, "calibration": {"placement": "time"}}
    assert legacy_plugins({"components": state}) == state
    assert legacy_plugins({"plugins": state, "components": {}}) == state
    assert legacy_plugins({"placement": "time"}) == {
        "calibration": {"placement": "time", **dict.fromkeys(("routing", "group_size", "windows"))}
    }
