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
    "knots_equal_exact",
    "wan_video",
    "sd3_kl",
    "flux_knots_720",
    "qwen_meta_load",
    "blocks",
    "flux_lora_512",
    "vae_rewards",
    "adamw_dcp",
    "trajectory_updates",
]
PLAN_STAGES = ["wan_video", "sd3_kl", "flux_knots_720"]


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
    # the default global budget holds one worker's start and every stage
    assert gpu_check.WORKER_START_S + sum(s.budget_s for s in gpu_check.STAGES) <= 480


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
    _check_plan_stages(stages)
    md = out.with_suffix(".md").read_text()
    assert "Tiny configs, not the real architectures" in md and "| trajectory_updates | ok |" in md
    assert "## wan_video" in md and "| knots K=4/batched | 4 |" in md


def _check_plan_stages(stages: dict) -> None:
    """The paper-config stages on the tiny models: every setting attempted (the tiny plans fit), with its passes,
    a finite gradient, the plan's terms, and the knots modes' gradients equal to each other."""
    want = {
        "wan_video": (10, {"exact": (10, 10), "knots K=4/sequential": (4, 4), "knots K=4/batched": (4, 4)}),
        "sd3_kl": (
            9,
            {"configured": (7, 7)},
        ),  # JAGG W = 3, jagg_frac 0.6 from base.yaml: 9 steps in 7 passes
        "flux_knots_720": (
            15,
            {"exact": (15, 15), "knots K=4/sequential": (4, 4), "knots K=4/batched": (4, 4)},
        ),
    }
    for name, (steps, passes) in want.items():
        result = stages[name]["result"]
        assert result["trained_steps"] == steps and result["memory_limit_gb"] == 80
        rows = {r["setting"]: r for r in result["rows"]}
        assert {k: (r["forward_passes_with_grad"], r["backward_passes"]) for k, r in rows.items()} == passes
        for r in rows.values():
            assert r["status"] == "ok" and r["fits"] and r["peak_gib"] is None  # no CUDA: no peak
            assert r["plan_needed_gib"] > r["plan_allocated_gib"] > 0
        if "exact" in rows:
            seq, stacked = rows["knots K=4/sequential"], rows["knots K=4/batched"]
            assert rows["exact"]["grad_rel_error_vs_first"] == 0.0
            assert seq["grad_rel_error_vs_first"] > 1e-3  # K = 4 of 10 or 15 steps: an approximation
            assert stacked["grad_rel_error_vs_first"] == pytest.approx(
                seq["grad_rel_error_vs_first"], rel=1e-4
            )
            assert (seq["plan_graphs_alive"], stacked["plan_graphs_alive"]) == (1, 4)
    assert stages["sd3_kl"]["result"]["batch"] == 9
    sd3 = stages["sd3_kl"]["result"]["rows"][0]["plan_terms_gib"]
    assert {"KL reference (unsharded copy)", "frozen base (replicated)"} <= set(sd3)


def test_real_configs_plans_on_one_gpu():
    """The plans of the real-size rows (meta models, no GPU): the configs and shapes the issue names, and the
    terms the plan counts for them; a row whose plan exceeds the limit carries the plan's reason."""
    wan = gpu_check.PaperUpdate.load(gpu_check.WAN_CONFIG, gpu_check.WAN_OVERRIDES, tiny=False)
    assert wan.trained_steps == 10 and wan.cfg.algorithm.kl_beta == 0
    assert (wan.cfg.sampling.latent_frames, wan.cfg.sampling.latent_size, wan.cfg.sampling.latent_width) == (
        21,
        60,
        104,
    )  # 81 frames of 480 x 832 px
    settings = gpu_check._knots_settings(wan.cfg)
    plans = {k: wan.plan(s, 80) for k, s in settings.items()}
    assert plans["exact"]["plan_allocated_gib"] == plans["knots K=4/sequential"]["plan_allocated_gib"]
    assert plans["knots K=4/batched"]["plan_graphs_alive"] == 4
    assert plans["knots K=4/batched"]["plan_allocated_gib"] > plans["exact"]["plan_allocated_gib"]
    tight = wan.plan(settings["knots K=4/batched"], plans["exact"]["plan_needed_gib"] * 2**30 / 1e9)
    assert not tight["fits"] and tight["reason"].startswith("the plan needs ")
    assert "activations (update)" in tight["reason"]
    sd3 = gpu_check.PaperUpdate.load(gpu_check.SD3_CONFIG, [], tiny=False)
    (plan,) = [sd3.plan(sd3.cfg.backward.planned_setting(), 80)]
    assert sd3.cfg.model.base_dtype == "fp32" and sd3.cfg.train.train_batch_size == 9
    assert plan["plan_terms_gib"]["KL reference (unsharded copy)"] == pytest.approx(8.4, abs=0.1)
    flux = gpu_check.PaperUpdate.load(gpu_check.FLUX_KNOTS_CONFIG, gpu_check.FLUX_KNOTS_OVERRIDES, tiny=False)
    assert flux.cfg.sampling.latent_size * 8 == 720 and flux.cfg.backward.knots == 4
    assert flux.cfg.model.lora_rank == 64 and flux.trained_steps == 15


def test_rows_the_plan_does_not_fit_are_not_attempted(tmp_path, monkeypatch):
    """A limit between the per-knot and the stacked plan: exact and sequential run, batched is skipped with the
    plan's reason and never built; under a limit nothing fits, the stage builds nothing."""
    run = gpu_check.PaperUpdate.load(
        gpu_check.WAN_CONFIG, gpu_check.WAN_OVERRIDES + ["train.train_batch_size=1"], True
    )
    needed = {k: run.plan(s, 80)["plan_needed_gib"] for k, s in gpu_check._knots_settings(run.cfg).items()}
    assert needed["knots K=4/batched"] > needed["knots K=4/sequential"]
    limit = (needed["knots K=4/batched"] + needed["knots K=4/sequential"]) / 2 * 2**30 / 1e9
    ctx = gpu_check.Context(device=torch.device("cpu"), tiny=True, log=lambda _: None, memory_gb=limit)
    rows = {r["setting"]: r for r in gpu_check.stage_wan_video(ctx, float("inf"))["rows"]}
    assert rows["exact"]["status"] == rows["knots K=4/sequential"]["status"] == "ok"
    batched = rows["knots K=4/batched"]
    assert batched["status"].startswith("skipped (the plan needs") and "seconds" not in batched
    monkeypatch.setattr(gpu_check.PaperUpdate, "build", lambda *a: pytest.fail("built a model nothing fits"))
    out = tmp_path / "gpu_check.json"
    argv = ["--out", str(out), "--stages", *PLAN_STAGES, "--no-isolate", "--memory-gb", "0.5"]
    assert gpu_check.main(argv) == 0
    report = json.loads(out.read_text())
    for s in report["stages"]:
        if s["name"] in PLAN_STAGES:
            assert s["status"] == "ok" and s["result"]["memory_limit_gb"] == 0.5
            assert all(r["status"].startswith("skipped (the plan needs") for r in s["result"]["rows"])
    assert "CPU" in report["meta"]["hardware"]


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


def test_stage_worker_runs_stages_in_one_child_and_restarts_after_a_crash(tmp_path):
    """On CUDA the stages run in a worker child (a CUDA error poisons its process): one child for the stages
    that pass, its records whole; a child that dies without a record is ``failed`` with the end of its stderr,
    and the next stage gets a fresh child."""
    by_name = {s.name: s for s in gpu_check.STAGES}
    worker = gpu_check.StageWorker(["--tiny", "--scratch", str(tmp_path)])
    try:
        first = worker.run(by_name["environment"], timeout_s=120)
        rec = worker.run(by_name["adamw_dcp"], timeout_s=120)
        assert first["status"] == rec["status"] == "ok" and first["worker"] == rec["worker"] == 1
        assert rec["result"]["written_gib"] > 0 and rec["process_s"] >= rec["seconds"] > 0
        missing = gpu_check.Stage(
            "no_such_stage", 10, lambda ctx, deadline: {}, "not in STAGES: the child dies"
        )
        dead = worker.run(missing, timeout_s=120)
        assert dead["status"] == "failed" and dead["error"].startswith("child process (1): KeyError")
        assert "no_such_stage" in dead["traceback"] and "Traceback" in dead["traceback"]
        after = worker.run(by_name["environment"], timeout_s=120)
        assert after["status"] == "ok" and after["worker"] == 2 and worker.starts == 2
    finally:
        worker.finish()
    assert not Path(worker.tmp).exists()


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
