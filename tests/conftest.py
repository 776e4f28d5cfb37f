"""Shared test setup: one torch thread (2-core machines), offline hub, small float64 models."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def world():
    """The embedded world's scene generator (prompts, renders, labels); shared by the world tests."""
    from jagg.world import World

    return World()


@pytest.fixture
def tiny_cfg(tmp_path):
    """Factory ``tiny_cfg(*overrides, config=..., run_dir=tmp_path, base=LOOP_RUN)``: a tiny run's config
    (``helpers.tiny_config``), by default the loop tests' run in this test's temporary directory."""
    from helpers import LOOP_RUN, tiny_config

    def make(*overrides, config="configs/world/flux_dancegrpo.yaml", run_dir=None, base=LOOP_RUN):
        return tiny_config(tmp_path if run_dir is None else run_dir, *overrides, config=config, base=base)

    return make


@pytest.fixture
def tiny_trainer(tiny_cfg):
    """Factory ``tiny_trainer(*overrides, **like tiny_cfg)``: the ``Trainer`` of ``tiny_cfg(...)``; pass a
    config instead with ``tiny_trainer(cfg=...)``."""
    from helpers import build_trainer

    def make(*overrides, cfg=None, **kwargs):
        return build_trainer(cfg if cfg is not None else tiny_cfg(*overrides, **kwargs))

    return make
