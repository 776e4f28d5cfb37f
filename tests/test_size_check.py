"""Sizes checked before the build (issue 41): a batch or a schedule too large for memory exits 2 with one line
naming the key and the largest value that fits, before the model is built and before run.json or the run
marker exist; a count beyond 64 bits is refused when the config loads."""

from __future__ import annotations

import re

import pytest

import jagg.loop.components
from jagg.capacity.memory_model import GIB, check_sizes, rollout_terms
from jagg.config import TINY_RUN, load_config
from jagg.errors import ConfigError
from jagg.train import main

WORLD = "configs/world/flux_dancegrpo.yaml"


@pytest.mark.parametrize(
    "override", ["train.prompts_per_iter=10000000000000", "sampling.num_steps=1000000000000"]
)
def test_too_large_exits_2_before_the_build(tmp_path, monkeypatch, capsys, override):
    def never(cfg):
        raise AssertionError("the model was built")

    monkeypatch.setattr(jagg.loop.components, "build_components", never)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["--config", WORLD, *TINY_RUN, f"log.run_dir={run}", override])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {override}: one rollout would hold"), err
    assert re.search(r"at most \d+ fits", err[0])
    assert not run.exists()  # no run.json, no marker, not even the directory


def test_the_named_limit_is_the_largest_value_that_fits():
    cfg = load_config(WORLD, [*TINY_RUN, "train.prompts_per_iter=10000000000000", "train.device=cpu"])
    host = 64 * GIB
    with pytest.raises(ConfigError) as exc:
        check_sizes(cfg, world_size=2, ranks_per_node=2, host_bytes=host)
    limit = int(re.search(r"at most (\d+) fits", str(exc.value)).group(1))
    assert "train.prompts_per_iter=10000000000000" in str(exc.value) and "shared by 2 ranks" in str(exc.value)
    for value, fits in ((limit, True), (limit + 1, False)):
        cfg.train.prompts_per_iter = value
        host_terms = sum(b for w, b in rollout_terms(cfg, 2).values() if w == "host")
        assert (host_terms <= host / 2) == fits
        if fits:
            check_sizes(cfg, world_size=2, ranks_per_node=2, host_bytes=host)


def test_a_gpu_run_is_bounded_by_the_largest_gpu():
    """The trajectories live on the GPU: a schedule whose latents exceed 141 GB names sampling.num_steps."""
    cfg = load_config(
        WORLD, [*TINY_RUN, "train.device=cuda", "sampling.num_steps=2000000", "sampling.latent_size=64"]
    )
    with pytest.raises(
        ConfigError, match=r"^sampling.num_steps=2000000: .* on the device, more than a 141 GB GPU"
    ):
        check_sizes(cfg, world_size=1, host_bytes=1e15)


def test_paper_configs_pass():
    for name in ("flux_dancegrpo", "qwenimage_mixgrpo"):
        cfg = load_config(f"configs/paper/{name}.yaml")
        check_sizes(cfg, world_size=8, ranks_per_node=8, host_bytes=1e12)


def test_a_count_beyond_64_bits_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"train.prompts_per_iter must be a 64-bit integer"):
        load_config(WORLD, [*TINY_RUN, f"train.prompts_per_iter={2**63}"])
