"""The dry-run plan's corrected terms (issue 19, item 7): prompt cache on the host, the batched mode's 2B
recompute, the text encoder staged on the host when embeddings are precomputed, and the disk figures."""

from __future__ import annotations

import pytest

from jagg.capacity.dry_run import build_plan
from jagg.capacity.memory_model import (
    GIB,
    HOST_BASELINE,
    PROMPT_LRU,
    block_bytes,
    disk_plan,
    embedding_bytes,
    memory_plan,
    meta_transformer,
)
from jagg.capacity.pass_plan import trained_steps_per_sample
from jagg.config import load_config
from jagg.scale.architectures import aux_params

QWEN_DANCE = "configs/paper/qwenimage_dancegrpo.yaml"
FLUX_DANCE = "configs/paper/flux_dancegrpo.yaml"


def _plan(path: str, *overrides: str):
    cfg = load_config(path, list(overrides))
    backward = cfg.backward
    setting = backward.planned_setting()
    cost = setting.cost(trained_steps_per_sample(cfg))
    held = backward.strategy != "exact" and backward.graph_mode == "joint"
    return cfg, memory_plan(cfg, 8, cost.graphs_alive, held)


def test_prompt_cache_is_host_memory_not_gpu():
    """Without a cache directory the in-memory embeddings count on every rank's host, never on its GPU."""
    cfg, mp = _plan(FLUX_DANCE, "data.embedding_cache=null")
    _, cached = _plan(FLUX_DANCE, "data.embedding_cache=cache/embeddings")
    model = meta_transformer(cfg)[0]
    lru = PROMPT_LRU * embedding_bytes(cfg, model)
    assert not any("prompt" in k for k in mp.gpu)
    assert mp.gpu == cached.gpu
    assert mp.host["other ranks"] - cached.host["other ranks"] == pytest.approx(lru)
    assert mp.host["rank 0"] - cached.host["rank 0"] == pytest.approx(lru)


def test_recompute_term_has_2b_rows_in_the_batched_mode():
    """The one recomputed block of the batched endpoint forward holds 2B rows; sequential holds B."""
    _, batched = _plan(FLUX_DANCE)
    cfg, seq = _plan(FLUX_DANCE, "backward.graph_mode=sequential")
    s, m = cfg.sampling, cfg.model
    per_layer = cfg.train.train_batch_size * ((s.latent_size // 2) ** 2 + m.max_sequence_length) * 3072
    blocks = 19 + 38
    saved, temporaries = block_bytes(cfg)
    assert (saved, temporaries) == (34, 0)  # Flux: GPT's figure (Korthikanti+22), no temporaries
    # batched: 2 graphs alive (one 2B graph); sequential: 1 graph alive
    assert batched.activations[True] == pytest.approx(2 * per_layer * blocks * 2 + 2 * per_layer * saved)
    assert seq.activations[True] == pytest.approx(per_layer * blocks * 2 + per_layer * saved)


def test_precomputed_embeddings_stage_the_text_encoder_on_the_host():
    """Qwen-Image DanceGRPO precomputes: every rank still loads Qwen2.5-VL-7B (bf16) once; rank 0 also holds
    the 20.4B transformer in bf16. ~57 GiB rank 0 / ~19 GiB other ranks (was 49 / 11: HPSv2.1's staging).
    Synchronous checkpoints: no CPU copy of a save (next test)."""
    cfg, mp = _plan(QWEN_DANCE, "log.async_checkpoint=false")
    qwen_vl = aux_params("qwen25_vl_7b") * 2
    n_all = sum(p.numel() for p in meta_transformer(cfg)[0].parameters())
    assert mp.host["other ranks"] == pytest.approx(HOST_BASELINE + qwen_vl)
    assert mp.host["rank 0"] == pytest.approx(HOST_BASELINE + qwen_vl + n_all * 2)
    assert 56 < mp.host["rank 0"] / GIB < 59 and 18 < mp.host["other ranks"] / GIB < 21


def test_async_checkpoints_hold_a_cpu_copy_of_each_ranks_share():
    """A CUDA run (auto) writes asynchronously from a CPU copy of each rank's share of the checkpoint (Qwen-Image
    full fine-tuning: 228 GiB / 8); it is held during training, so it counts against the loading's transients
    (the larger of the two), not on top of them."""
    cfg, mp = _plan(QWEN_DANCE)
    _, sync = _plan(QWEN_DANCE, "log.async_checkpoint=false")
    share = disk_plan(cfg, meta_transformer(cfg)[0])["checkpoint"] / 8
    assert (
        cfg.train.device == "cuda"
        and mp.checkpoint_copy == pytest.approx(share)
        and sync.checkpoint_copy == 0
    )
    loading = sync.host["other ranks"] - HOST_BASELINE
    assert mp.host["other ranks"] == pytest.approx(HOST_BASELINE + max(loading, share))
    assert 28 < share / GIB < 29 and mp.host["rank 0"] == sync.host["rank 0"]  # rank 0's loading is larger
    _, cpu = _plan(QWEN_DANCE, "train.device=cpu")
    assert cpu.checkpoint_copy == 0


def test_dry_run_states_disk():
    """Checkpoint = trained fp32 weights + two fp32 moments; written beside the previous one; cache size."""
    cfg = load_config(QWEN_DANCE)
    model = meta_transformer(cfg)[0]
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    disk = disk_plan(cfg, model)
    assert disk["checkpoint"] == n * 12
    assert 220 < disk["checkpoint"] / GIB < 235  # ~228 GiB for Qwen-Image full fine-tuning
    assert disk["embedding cache"] == (100_000 + 400) * embedding_bytes(cfg, model)
    text = str(build_plan(cfg, 8))
    assert "checkpoint.tmp beside the previous checkpoint" in text and "embedding cache" in text
    lora = load_config("configs/paper/flux_flowgrpo_fast.yaml")
    lora_model = meta_transformer(lora)[0]
    trained = sum(p.numel() for p in lora_model.parameters() if p.requires_grad)
    assert disk_plan(lora, lora_model) == {"checkpoint": trained * 12, "embedding cache": 0.0}


QWEN_FAST = "configs/paper/qwenimage_flowgrpo_fast.yaml"


def _trained(cfg) -> int:
    return sum(p.numel() for p in meta_transformer(cfg)[0].parameters() if p.requires_grad)


def test_true_cfg_holds_one_unsharded_gradient_per_block():
    """Issue 30: Qwen-Image's true CFG makes two transformer calls per velocity; one call's backward passes
    every block before the other's reaches it, so every block holds its unsharded (bf16) gradient: ~0.8 GiB
    for the LoRA config, ~38 GiB for full fine-tuning with CFG."""
    cfg, mp = _plan(QWEN_FAST)
    held = mp.gpu["unsharded gradients held (true CFG)"]
    assert held == _trained(cfg) * 2 and 0.7 < held / GIB < 0.9
    full_cfg, full = _plan(QWEN_DANCE, "model.true_cfg_scale=4.0")
    assert 37 < full.gpu["unsharded gradients held (true CFG)"] / GIB < 39
    _, joint = _plan(QWEN_FAST, "backward.graph_mode=joint")  # the same buffers: counted once
    assert joint.gpu["unsharded gradients held (joint / true CFG)"] == held
    _, flux = _plan(FLUX_DANCE)
    assert not any(k.startswith("unsharded gradients held") for k in flux.gpu)


def test_fused_adamw_has_no_step_temporaries():
    cfg, foreach = _plan(QWEN_DANCE)
    _, fused = _plan(QWEN_DANCE, "optim.fused=true")
    assert foreach.step == _trained(cfg) * 4 / 8 and fused.step == 0.0
    assert "AdamW step temporaries (fused)" in str(
        build_plan(load_config(QWEN_DANCE, ["optim.fused=true"]), 8)
    )


def test_context_and_allocator_are_their_own_terms(monkeypatch):
    """CUDA context + NCCL (assumed 1.5 GiB) and the allocator's fragmentation (2% of the allocated peak with
    expandable_segments, the CUDA runs' default; 10% with the user's own setting without it)."""
    from jagg.capacity.memory_model import ALLOCATOR_SLACK, CUDA_CONTEXT

    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    _, mp = _plan(QWEN_DANCE)
    assert mp.expandable_segments and mp.total() == pytest.approx(mp.allocated() * 1.02 + CUDA_CONTEXT)
    text = str(build_plan(load_config(QWEN_DANCE), 8))
    assert "CUDA context + NCCL buffers" in text and "allocator fragmentation" in text and "2% of" in text
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    _, plain = _plan(QWEN_DANCE)
    assert not plain.expandable_segments
    assert plain.total() - mp.total() == pytest.approx(mp.allocated() * (ALLOCATOR_SLACK[False] - 0.02))
    assert "OFF in PYTORCH_CUDA_ALLOC_CONF" in str(build_plan(load_config(QWEN_DANCE), 8))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:512")
    assert _plan(QWEN_DANCE)[1].expandable_segments
