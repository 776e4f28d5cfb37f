"""The calibrators' keys (issue 57): each calibrator of ``jagg.loop.calibration`` points at a frozen config of the
engine's registry ``CALIBRATIONS`` (its keys, defaults and checks), the ``backward:`` section composes those keys
at their old flat paths, and a calibrator reads its cadence and threshold from its own config."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from jagg.config import BackwardConfig, ConfigError, load_config
from jagg.engine.algorithms import ALGORITHMS
from jagg.engine.routing import CALIBRATIONS
from jagg.loop.calibration import GroupsCalibrator, KnotsCalibrator, WindowsCalibrator, calibrator_for

CALIBRATORS = {"groups": GroupsCalibrator, "windows": WindowsCalibrator, "knots": KnotsCalibrator}


def test_each_calibrator_points_at_its_registry_entry():
    assert set(CALIBRATORS) == set(CALIBRATIONS)
    for kind, calibrator in CALIBRATORS.items():
        assert calibrator.CONFIG is CALIBRATIONS[kind], kind
        assert calibrator.CONFIG.__dataclass_params__.frozen, kind


def test_the_backward_section_composes_every_calibration_key_with_its_default():
    """Each calibrator's key is a ``backward.<key>`` whose default is the calibrator config's; nothing else of
    the section is a calibration key (the routing keys are the section's own)."""
    backward = {f.name: f for f in dataclasses.fields(BackwardConfig)}
    declared = {f.name: f for config in CALIBRATIONS.values() for f in dataclasses.fields(config)}
    assert declared and set(declared) <= set(backward)
    defaults = BackwardConfig()
    for config in CALIBRATIONS.values():
        for f in dataclasses.fields(config):
            assert getattr(defaults, f.name) == getattr(config(), f.name), f.name
    assert {"calibrate_every", "min_cosine", "group_sizes"} == set(declared)
    assert {"strategy", "group_size", "jagg_frac", "placement"} <= set(backward) - set(declared)


@pytest.mark.parametrize(
    ("override", "kind", "message"),
    [
        ("backward.calibrate_every=0", "knots", "backward.calibrate_every must be >= 1, got 0"),
        ("backward.min_cosine=1.5", "windows", "backward.min_cosine must be in [-1, 1], got 1.5"),
        (
            "backward.group_sizes=[1]",
            "groups",
            "backward.group_sizes must be a non-empty list of integers >= 2",
        ),
    ],
)
def test_a_calibration_key_is_checked_by_its_calibrators_config(override, kind, message):
    """The run's config refuses the value with the message of the calibrator config that declares the key."""
    key, value = override.split("=")
    config = CALIBRATIONS[kind](**{key.split(".")[1]: yaml.safe_load(value)})
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.validate()
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_a_calibrator_reads_its_cadence_and_threshold_from_its_config():
    cfg = load_config(
        None, ["backward.jagg_frac=auto", "backward.calibrate_every=7", "backward.min_cosine=0.5"]
    )
    algorithm = ALGORITHMS[cfg.algorithm.name](cfg.algorithm, cfg.backward)
    calibrator = calibrator_for(cfg.backward, algorithm, cfg.sampling.num_steps, 0)
    assert isinstance(calibrator, GroupsCalibrator)
    assert (calibrator.keys.calibrate_every, calibrator.keys.min_cosine) == (7, 0.5)
    assert calibrator.due(3)  # nothing measured yet
    calibrator.setting = cfg.backward.planned_setting()
    assert [it for it in range(15) if calibrator.due(it)] == [0, 7, 14]
