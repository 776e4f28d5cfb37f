"""``make gpu-check`` without CUDA: every stage's tiny version, one JSON outside results/gpu/, the stage machinery."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import gpu_check  # noqa: E402
from jagg.ops.node import apply_sdpa_kernels, sdpa_kernel_flags  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="covers the CPU path (no CUDA)")
STAGE_NAMES = [
    "environment",
    "qwen_meta_load",
    "blocks",
    "flux_lora_512",
    "vae_rewards",
    "adamw_dcp",
    "trajectory_updates",
    "knots_equal_exact",
]


@pytest.fixture(autouse=True)
def _sdpa_flags_restored():
    """``main`` enables the attention kernels it checks (process-wide flags): each test leaves them as found."""
    flags = sdpa_kernel_flags()
    yield
    apply_sdpa_kernels([k for k, on in flags.items() if on])


class FakeClock:
    """A clock that stages advance by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _ctx() -> gpu_check.Context:
    return gpu_check.Context(device=torch.device("cpu"), tiny=True, log=lambda _: None)


def test_cpu_default_output_is_not_results_gpu():
    assert gpu_check.default_out(cuda=True) == "results/gpu/gpu_check.json"
    assert not gpu_check.default_out(cuda=False).startswith("results/")
    assert [s.name for s in gpu_check.STAGES] == STAGE_NAMES
    assert sum(s.budget_s for s in gpu_check.STAGES) <= 480  # the default global budget holds every stage


def test_meta_built_transformer_keeps_the_rope_tables():
    """Qwen-Image's RoPE tables are plain attributes: the meta build takes them from a CPU-built copy."""
    from jagg.models import BACKBONES, TINY_CONFIGS

    cfg = TINY_CONFIGS["qwenimage"]()
    built = gpu_check.build_transformer("qwenimage", cfg, torch.device("cpu"), torch.float32, seed=0)
    ref = BACKBONES["qwenimage"].transformer_cls.from_config(cfg)
    torch.testing.assert_close(built.pos_embed.pos_freqs, ref.pos_embed.pos_freqs)
    assert built.gradient_checkpointing and not any(p.is_meta for p in built.parameters())


def _trajectory_rows(rows: list[dict]) -> dict[tuple, dict]:
    """The counts of one DanceGRPO trajectory's update in every variant (9 trained steps, W = 3, 2 JAGG groups)."""
    want = {s.label for s in gpu_check.SETTINGS}
    assert want == {"exact"} | {
        f"jagg/{m}{s}" for m in ("batched", "joint", "sequential") for s in ("", "+stored")
    }
    groups: dict[tuple, dict] = {}
    for r in rows:
        assert r["status"] == "ok" and r["config"] == "tiny"
        groups.setdefault((r["backbone"], r["resolution_px"], r["gradients"]), {})[r["variant"]] = r
    for variants in groups.values():
        assert set(variants) == want
        assert (variants["exact"]["forward_passes"], variants["exact"]["backward_passes"]) == (9, 9)
        stored = variants["jagg/batched+stored"]
        assert (stored["forward_passes"], stored["backward_passes"]) == (7, 7)
        assert variants["jagg/batched"]["forward_passes"] == 9
        assert variants["jagg/sequential"]["backward_calls"] == 7
    return groups


def test_cpu_run_writes_one_json_with_every_stage(tmp_path, capsys):
    out = tmp_path / "gpu" / "gpu_check.json"
    assert gpu_check.main(["--out", str(out), "--scratch", str(tmp_path)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    report = json.loads(out.read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == STAGE_NAMES
    for s in stages.values():  # on CPU every tiny stage fits: ok, or skipped with a reason
        assert s["status"] == "ok" or (s["status"] == "skipped" and s["reason"]), s
    assert all(s["status"] == "ok" for s in stages.values())
    assert report["meta"]["tiny"] is True and "CPU" in report["meta"]["hardware"]
    assert report["meta"]["git_sha"] and report["wall_s"] <= report["budget_s"]

    env = stages["environment"]["result"]
    assert env["torch"] == torch.__version__ and env["sdpa_kernels"]["math"]["status"] == "ok"
    assert set(env["sdpa_kernels"]) == {"flash_attention", "efficient_attention", "cudnn_attention", "math"}
    qwen = stages["qwen_meta_load"]["result"]
    assert set(qwen["rotary_tables"]) == {"pos_freqs", "neg_freqs"}
    assert qwen["sharded_vs_unsharded_max_rel_err"] <= 1e-5
    for name in ("flux", "qwenimage"):
        b = stages["blocks"]["result"][name]
        kinds = {
            "flux": {"transformer_blocks": 2, "single_transformer_blocks": 2},
            "qwenimage": {"transformer_blocks": 2},
        }
        assert {k: sum(r["kind"] == k for r in b["blocks"]) for k in kinds[name]} == kinds[name]
        assert b["checkpointing_grad_max_rel_err"] <= b["checkpointing_grad_tolerance"] == 1e-5
        assert b["gradients_compared"] > 0
    lora = _trajectory_rows(stages["flux_lora_512"]["result"]["rows"])
    assert set(lora) == {("flux", 512, "lora")}
    vr = stages["vae_rewards"]["result"]
    assert vr["vae"]["image"] == [1, 3, 16, 16]
    assert {k: v["status"] for k, v in vr["rewards"].items()} == dict.fromkeys(
        ("hpsv2", "pickscore", "clipscore"), "ok"
    )
    dcp = stages["adamw_dcp"]["result"]
    assert dcp["written_gib"] >= 3 * dcp["shard_gib"]  # the shard and AdamW's two moments
    assert not list(tmp_path.glob("gpu_check_dcp_*"))  # the scratch checkpoint is removed
    groups = _trajectory_rows(stages["trajectory_updates"]["result"]["rows"])
    assert set(groups) == {
        (b, px, g) for b, pxs in gpu_check.RESOLUTIONS.items() for px in pxs for g in ("full", "lora")
    }
    full, lora = (groups[("flux", 720, g)]["exact"] for g in ("full", "lora"))
    assert full["trainable_m"] == pytest.approx(full["params_b"] * 1e3)  # every weight
    assert lora["trainable_m"] != full["trainable_m"]  # adapters only
    knots = {r["precision"]: r for r in stages["knots_equal_exact"]["result"]["comparisons"]}
    assert knots["fp32"]["knots"] == knots["fp32"]["trained_steps"] > 1
    assert knots["fp32"]["rel_error"] < 1e-5  # tiny on the CPU: bf16 autocast is CUDA's only
    assert knots["bf16"]["status"].startswith("skipped (bf16")
    md = out.with_suffix(".md").read_text()
    assert "Tiny configs, not the real architectures" in md and "| trajectory_updates | ok |" in md


def test_failing_stage_is_reported_and_the_others_run(tmp_path, monkeypatch):
    def broken(ctx, deadline):
        raise RuntimeError("CUDA error: an illegal memory access\nwas encountered")

    stages = [
        s if s.name != "qwen_meta_load" else gpu_check.Stage(s.name, s.budget_s, broken, s.about)
        for s in gpu_check.STAGES
    ]
    monkeypatch.setattr(gpu_check, "STAGES", stages)
    out = tmp_path / "gpu_check.json"
    picked = ["environment", "qwen_meta_load", "adamw_dcp"]
    assert gpu_check.main(["--out", str(out), "--stages", *picked, "--scratch", str(tmp_path)]) == 0
    report = {s["name"]: s for s in json.loads(out.read_text())["stages"]}
    assert report["qwen_meta_load"]["status"] == "failed"
    assert (
        report["qwen_meta_load"]["error"]
        == "RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    assert report["environment"]["status"] == report["adamw_dcp"]["status"] == "ok"  # before and after it
    assert {n for n, s in report.items() if s["status"] == "skipped"} == set(STAGE_NAMES) - set(picked)
    assert all("not selected" in report[n]["reason"] for n in set(STAGE_NAMES) - set(picked))


def test_budget_skips_a_stage_that_would_start_with_too_little_time():
    clock, ran = FakeClock(), []

    def taking(seconds: float):
        def fn(ctx, deadline):
            ran.append(seconds)
            clock.now += seconds
            return {"took": seconds}

        return fn

    stages = [
        gpu_check.Stage("a", 30, taking(50), "over its own budget"),
        gpu_check.Stage("b", 60, taking(1), "needs 60 s, 50 left"),
        gpu_check.Stage("c", 40, taking(10), "fits in the 50 s left"),
        gpu_check.Stage("d", 40, taking(1), "needs 40 s, 40 left: starts"),
        gpu_check.Stage("e", 40, taking(1), "needs 40 s, 39 left"),
    ]
    written: list[int] = []
    records = gpu_check.run_stages(
        stages, _ctx(), 100, clock=clock, on_record=lambda r: written.append(len(r))
    )
    recs = {r["name"]: r for r in records}
    assert ran == [50, 10, 1] and written == [1, 2, 3, 4, 5]  # the JSON is rewritten after every stage
    assert [recs[n]["status"] for n in "abcde"] == ["ok", "skipped", "ok", "ok", "skipped"]
    assert recs["a"]["seconds"] == 50 and recs["a"]["over_budget"] is True
    assert recs["c"]["over_budget"] is False and recs["c"]["result"] == {"took": 10}
    assert recs["b"]["reason"] == "over budget: 50 s left of 100 s, the stage needs 60 s"
    assert recs["e"]["reason"].startswith("over budget: 39 s left")


def test_error_line_is_one_line():
    assert gpu_check.error_line(ValueError("a\nb")) == "ValueError: a b"
    assert len(gpu_check.error_line(RuntimeError("x" * 2000))) == 500


def test_real_reward_architectures_build_offline_on_meta():
    """The CUDA path's reward models (hub architectures, no weights) build and match the published sizes."""
    from jagg.scale.architectures import AUX_MODELS

    ctx = gpu_check.Context(device=torch.device("meta"), tiny=False, log=lambda _: None)
    for name, build in gpu_check._reward_models(ctx).items():
        reward = build()
        n = sum(p.numel() for p in reward.model.parameters())
        assert n == pytest.approx(AUX_MODELS[name][1], rel=1e-3), name
        assert reward.image_size == 224


def test_settings_come_from_the_paper_configs():
    """The trajectory, LoRA and resolutions are read from configs/paper/, not copied (issue 30)."""
    from jagg.config import load_config

    dance, fast = (load_config(f"configs/paper/{n}.yaml") for n in ("flux_dancegrpo", "flux_flowgrpo_fast"))
    assert (gpu_check.NUM_STEPS, gpu_check.SHIFT, gpu_check.ETA) == (16, 3.0, 0.3)
    assert (dance.sampling.num_steps, dance.algorithm.noise_level) == (gpu_check.NUM_STEPS, gpu_check.ETA)
    assert (3, 0.6, dance.algorithm.clip_range) == (gpu_check.GROUP_SIZE, gpu_check.JAGG_FRAC, gpu_check.CLIP)
    assert (
        (gpu_check.LORA_RANK, gpu_check.LORA_ALPHA)
        == (fast.model.lora_rank, fast.model.lora_alpha)
        == (64, 128)
    )
    assert gpu_check.RESOLUTIONS == {"flux": (720,), "qwenimage": (720, 512)}
    assert gpu_check.TEXT_TOKENS["flux"] == dance.model.max_sequence_length == 512


def test_isolated_stage_runs_in_a_child_and_a_crashed_child_is_a_failed_record(tmp_path):
    """On CUDA each stage runs in its own process (a CUDA error poisons its process): the child's record comes
    back whole; a child that dies without one is ``failed`` with the end of its stderr, and the run goes on."""
    argv = ["--tiny", "--scratch", str(tmp_path)]
    by_name = {s.name: s for s in gpu_check.STAGES}
    rec = gpu_check.run_isolated(by_name["adamw_dcp"], argv, timeout_s=120)
    assert rec["status"] == "ok" and rec["result"]["written_gib"] > 0
    assert rec["process_s"] >= rec["seconds"] > 0  # the child's start is on top of the stage's own time
    missing = gpu_check.Stage("no_such_stage", 10, lambda ctx, deadline: {}, "not in STAGES: the child dies")
    dead = gpu_check.run_isolated(missing, argv, timeout_s=120)
    assert dead["status"] == "failed" and dead["error"].startswith("child process (1): KeyError")
    assert "no_such_stage" in dead["traceback"] and "Traceback" in dead["traceback"]


def test_failed_stage_keeps_its_traceback_and_sdpa_restricts_the_kernels(tmp_path, monkeypatch):
    def broken(ctx, deadline):
        raise RuntimeError("deep inside")

    monkeypatch.setattr(gpu_check, "STAGES", [gpu_check.Stage("a", 10, broken, "raises")])
    out = tmp_path / "gpu_check.json"  # the autouse fixture restores the flags main sets
    assert gpu_check.main(["--out", str(out), "--sdpa", "mem_efficient", "math", "--no-isolate"]) == 0
    assert sdpa_kernel_flags() == {"flash": False, "mem_efficient": True, "cudnn": False, "math": True}
    report = json.loads(out.read_text())
    (stage,) = report["stages"]
    assert stage["status"] == "failed" and "in broken" in stage["traceback"]
    assert report["meta"]["config"]["sdpa"] == ["mem_efficient", "math"]
    assert report["meta"]["isolated_stages"] is False


def test_default_attention_kernels_are_the_paper_configs(tmp_path):
    """Without --sdpa the check enables what a paper run enables (train.sdpa_kernels), and records it."""
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--out", str(out), "--stages", "environment", "--no-isolate"]) == 0
    report = json.loads(out.read_text())
    want = gpu_check.paper_config("flux_dancegrpo").train.sdpa_kernels
    assert want == ["flash", "mem_efficient", "math"] and report["meta"]["config"]["sdpa"] == want
    env = report["stages"][0]["result"]
    assert env["sdpa_flags"] == {k: k in want for k in gpu_check.SDPA_KERNELS}
