"""``optim.fused``: the trainer's AdamW is torch's foreach by default and the fused kernel on request; both
give the same step; where torch has no fused kernel the CLI exits 2 with one line, before the model loads."""

from __future__ import annotations

import pytest
import torch

from jagg.config import TINY_RUN
from jagg.train import main


def test_fused_equals_foreach_after_an_iteration(tiny_trainer):
    a, b = tiny_trainer(), tiny_trainer("optim.fused=true")
    assert a.optimizer.defaults["fused"] is None and b.optimizer.defaults["fused"] is True
    before = [p.detach().clone() for p in a.params]
    a.train_iteration(0)
    b.train_iteration(0)
    moved = max((p - q).abs().max().item() for p, q in zip(a.params, before))
    assert moved > 1e-6  # the step did something
    for p, q in zip(a.params, b.params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_unsupported_fused_exits_2_before_loading(tmp_path, capsys, monkeypatch):
    import torch.utils._foreach_utils as fu

    monkeypatch.setattr(fu, "_get_fused_kernels_supported_devices", lambda: ["cuda"])
    run_dir = tmp_path / "run"
    argv = [
        "--config",
        "configs/world/flux_dancegrpo.yaml",
        *TINY_RUN,
        f"log.run_dir={run_dir}",
        "optim.fused=true",
    ]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "optim.fused=true: torch has no fused AdamW for device 'cpu'" in err
    assert not run_dir.exists()


def test_failing_fused_kernel_is_a_config_error(tiny_cfg, monkeypatch):
    """torch checks devices and dtypes only at the first step: ``check_fused`` takes one, and a kernel that
    fails there (mocked) becomes a ConfigError naming the key."""
    from jagg.errors import ConfigError
    from jagg.scale.optimizer import check_fused

    check_fused(tiny_cfg("optim.fused=true"), torch.device("cpu"))  # supported here: no error

    def no_kernel(*args, **kwargs):
        raise RuntimeError("no fused kernel for this dtype\nmore detail")

    monkeypatch.setattr(torch, "_fused_adamw_", no_kernel)
    with pytest.raises(ConfigError, match=r"fused AdamW failed on cpu / torch.float32 \(no fused kernel"):
        check_fused(tiny_cfg("optim.fused=true"), torch.device("cpu"))
    check_fused(tiny_cfg(), torch.device("cpu"))  # not asked for: not tried
