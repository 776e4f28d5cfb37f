# JAGG reproduction. `make help` lists every target. Every target that needs Python builds .venv first.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Offline by default (no model hub at run time); set HF_HUB_OFFLINE=0 for real weights on a connected machine.
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= $(HF_HUB_OFFLINE)
# One torch thread per process (2-core machines: OpenMP spin-wait makes 2 threads up to 85x slower).
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export PYTHONHASHSEED := 0
# The CPU's float kernels: AVX2 by default on every x86-64 CPU, so that the world's build (results/world.json),
# every run on it and the tests' golden runs (tests/golden/) come out bit for bit the same on AVX2 and AVX-512
# machines (docs/decisions.md 26). KERNELS=native takes the CPU's own: faster on AVX-512 (the world's
# pretraining about 1.3x), but another build, and the golden runs then fail there. Nothing changes on GPUs or ARM.
KERNELS ?= avx2
ifeq ($(KERNELS),avx2)
export ATEN_CPU_CAPABILITY := avx2
export MKL_ENABLE_INSTRUCTIONS := AVX2
export ONEDNN_MAX_CPU_ISA := AVX2
else ifneq ($(KERNELS),native)
$(error KERNELS must be avx2 (the default: the committed world's kernels) or native (the CPU's own), got '$(KERNELS)')
endif
SCALE ?= world

.PHONY: help venv kernels smoke test drill test-dist engines lint format bench bench-checkpoint gpu-check plan-check check-weights hpsv2-ref hpsv3-ref pretrain clean theorem table1 cosine knots routing curves curves-pilot curves-practitioners curves-equal-cost curves-window curves-v3 curves-long judges-ood world-rl figures notebooks all

help: ## List every target
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  make %-12s %s\n", $$1, $$2}'

# UniRL (jagg.integrations.unirl): its metadata asks for Python >= 3.12 and transformers < 5.13, its code runs here
# (tests/test_integrations_unirl.py), so it gets its own pip line without dependencies; requirements-engines.txt
# holds what it imports.
UNIRL := unirl==0.2.0
$(STAMP): requirements.txt requirements-engines.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "Installing pinned dependencies into $(VENV) (first run: a few minutes)..."
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt 2>&1 | { grep -v "^WARNING: Location" || true; }
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-engines.txt 2>&1 | { grep -v "^WARNING: Location" || true; }
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --ignore-requires-python $(UNIRL) 2>&1 | { grep -v "^WARNING: Location" || true; }
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | { grep -v "^WARNING: Location" || true; }
	@touch $(STAMP)

venv: $(STAMP) ## Create .venv with the pinned dependencies (done automatically by every target)

kernels: $(STAMP) ## The float kernels torch runs every target on here (KERNELS=avx2, the default, or native)
	@$(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability())"

smoke: $(STAMP) ## ~1 min: 2 GRPO iterations with JAGG on a random-init tiny Flux (no pretraining) -> runs/smoke/
	$(PY) -m jagg.train --config configs/world/flux_dancegrpo.yaml --overwrite model.source=tiny \
		'reward.weights={jpeg: 1.0}' 'reward.eval=[jpeg]' train.iterations=2 train.prompts_per_iter=2 \
		train.images_per_prompt=4 train.train_batch_size=4 train.grad_accum=2 log.eval_every=2 log.eval_prompts=4 \
		log.run_dir=runs/smoke
	@echo "smoke run: runs/smoke/metrics.jsonl, runs/smoke/samples/, runs/smoke/checkpoint/"

TEST_WORKERS ?= 2  # pytest-xdist processes, one torch thread each: both cores of a 2-core machine
test: $(STAMP) ## Run the test suite on TEST_WORKERS processes (creates .venv if missing)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

drill: $(STAMP) ## The hostile drill's slow cases, kept out of make test (pytest marker drill): real torchrun agents signalled, ranks stopped or failed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m drill

test-dist: $(STAMP) ## 2-process FSDP2 tests on CPU (gloo): group backward, trainer, torchrun CLI, checkpoints / loading / export
	$(PY) -m pytest -q tests/test_dist_harness.py tests/test_distributed.py tests/test_distributed_trainer.py tests/test_distributed_checkpoint.py

engines: $(STAMP) ## JAGG inside the engines: accelerate, UniRL (installed by the venv), Flow-Factory (FLOW_FACTORY=<source tree at a0b2bc5> for its source-tree test)
	$(PY) -m pytest -q -n 0 tests/test_integrations.py tests/test_integrations_unirl.py tests/test_integrations_flow_factory.py

lint: $(STAMP) ## ruff check + format check
	$(PY) -m ruff check src tests experiments examples
	$(PY) -m ruff format --check src tests experiments examples

format: $(STAMP) ## Auto-format with ruff
	$(PY) -m ruff format src tests experiments examples
	$(PY) -m ruff check --fix src tests experiments examples

bench: $(STAMP) ## Time one group, exact vs JAGG, on tiny Flux / Qwen-Image backbones -> results/bench_group_backward.csv
	$(PY) experiments/bench_group_backward.py --repeats 15 --out results/bench_group_backward.csv

bench-checkpoint: $(STAMP) ## Training blocked by a checkpoint save, synchronous vs asynchronous (log.async_checkpoint), random-init Flux on the CPU -> results/checkpoint_async.csv
	$(PY) experiments/checkpoint_bench.py --repeats 5 --out results/checkpoint_async.csv

gpu-check: $(STAMP) ## One 80 GB GPU, <= 8 min, no weights, stages with time budgets (a failing one does not stop the rest): environment + SDPA kernels, knots K = T vs exact, Wan2.1-1.3B video / SD3.5-M KL / Flux 720 px knots against the memory plan (rows over 80 GB not attempted), Qwen meta load, blocks at real width, Flux LoRA 512 px, VAE + rewards, AdamW + DCP save, every JAGG mode's update -> results/gpu/gpu_check.json (without CUDA: tiny versions -> runs/gpu_check/)
	$(PY) experiments/gpu_check.py

plan-check: $(STAMP) ## Simulated 8-GPU node on the CPU (fake tensors + fake process group + FSDPMemTracker): one real-size update per paper config next to the dry-run plan, and Wan2.1-1.3B video exact vs knots stacked / per knot -> results/plan_check.md
	$(PY) experiments/plan_check.py

check-weights: $(STAMP) ## CONFIG=configs/paper/X.yaml [OVERRIDES='model.path=/local/FLUX.1-dev']: every checkpoint the config loads (transformer, text encoders, VAE, rewards) against its model built on the meta device, keys and shapes, from a local path or the hub cache (headers / mmap only, no download)
	@test -n "$(CONFIG)" || { echo "usage: make check-weights CONFIG=configs/paper/flux_dancegrpo.yaml [OVERRIDES='model.path=...']"; exit 2; }
	$(PY) -m jagg.scale.weights_check --config $(CONFIG) $(OVERRIDES)

hpsv2-ref: $(STAMP) ## Optional: the hpsv2 reference (hpsv2x 1.2.0, no deps, into cache/hpsv2x; pins untouched), then test our HPSv2.1 scorer against it
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --upgrade --target cache/hpsv2x hpsv2x==1.2.0 2>&1 | { grep -v "^WARNING: Location" || true; }
	$(PY) -m pytest -q tests/test_hpsv2_reference.py

hpsv3-ref: $(STAMP) ## Optional: the hpsv3 1.0.0 sdist (no deps, into cache/hpsv3), then compare our HPSv3 prompt, chat turn, resize and head with it
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: hpsv3==1.0.0 -d cache/hpsv3
	$(PY) -m pytest -q tests/test_hpsv3_reference.py

pretrain: $(STAMP) ## Train + cache the offline world (text encoder, rewards, tiny Flux / Qwen-Image) -> cache/world, results/world.md
	$(PY) experiments/pretrain.py

clean: ## Remove caches and run directories (keeps .venv and results/)
	rm -rf runs .pytest_cache .ruff_cache
	find . -name __pycache__ -prune -exec rm -rf {} +

theorem: $(STAMP) ## Theorem 1 numerically: JAGG error vs nonlinearity, curvature, W -> results/theorem1.csv, paper_figures/theorem1.png
	$(PY) experiments/theorem1.py

table1: $(STAMP) pretrain ## Wall-clock per iteration, exact vs JAGG vs endpoints, 2 backbones x 2 algorithms, the JAGG authors' recipe side by side, where practitioners train (MixGRPO, full trajectory with knots, Fast window of 2), and SD3.5-M's Flow-GRPO recipe on a tiny random-init SD3, and the video world's Wan with every step trained (T = 10 / 20) -> results/table1{,_authors,_practitioners,_sd3,_video}.csv, table1.{md,tex}
	$(PY) experiments/table1.py --scale $(SCALE)

cosine: $(STAMP) pretrain ## Gradient quality per group: cosine(JAGG, exact), and t- vs index weights on contiguous vs sorted-subset groups (the authors' recipe) -> results/cosine{,_authors}.csv, cosine.md, paper_figures/cosine_*.png
	$(PY) experiments/cosine.py

knots: $(STAMP) pretrain ## Shared knots vs JAGG groups: cosine to exact vs backward passes per sample (both world backbones, full trajectory / DanceGRPO 12 of 20 / the authors' blocks), full-trajectory timing (~35 min); the video world's Wan at T = 10 / 20 -> results/knots{,_time,_video}.csv, knots{,_video}.md, paper_figures/knots_cosine{,_video}.png
	$(PY) experiments/knots.py
	$(PY) experiments/knots.py --video

routing: $(STAMP) pretrain ## What backward.jagg_frac/group_size=auto choose per world backbone x algorithm, timed vs jagg_frac 0.6 -> results/routing.{csv,md}
	$(PY) experiments/routing.py

V4 := experiments/curves_protocol_v4.yaml
curves: $(STAMP) pretrain ## Reward curves under protocol v4 (experiments/curves_protocol_v4.yaml): the authors' structure, amendment 1: reference exact_blocks (exact on the same blocks), jagg / jagg_index / endpoints / knots, the authors' exact as a baseline, controls on the blocks at cosines 0.95, 0.8, 0.5 (fixed and fresh direction), fidelity, divergence, dose-response; resumes from results/curves_v4/ (hours; QUICK=1: a smoke run) -> results/curves_v4/, paper_figures/reward_curves_authors.png
	$(PY) experiments/curves.py --protocol $(V4) $(if $(QUICK),--quick,)

curves-pilot: $(STAMP) pretrain ## Protocol v4's pilot (seeds 900-902, exact / jagg / endpoints / control 0.5) and the sizing of its seeds (~1 h) -> results/curves_v4_pilot/
	$(PY) experiments/curves.py --protocol $(V4) --pilot

curves-practitioners: $(STAMP) pretrain ## Protocol v4's instruments on MixGRPO's window (exact / jagg / measured routing) and on every step trained (exact 20 of 20 / knots K=4, 6 / DanceGRPO's 12 exact), controls 0.95 / 0.8 / 0.5; resumes from results/curves_practitioners/ (hours; PILOT=1: its pilot) -> results/curves_practitioners{,_pilot}/
	$(PY) experiments/curves.py --protocol experiments/curves_protocol_practitioners.yaml $(if $(PILOT),--pilot,)

curves-equal-cost: $(STAMP) pretrain ## Equal cost (experiments/curves_protocol_equal_cost.yaml): every step (exact / knots 3, 4 / JAGG W=4) against DanceGRPO 12, Flow-GRPO-Fast's window of 2, one step, MixGRPO's window of 4 (exact / JAGG), each for exact's 24-iteration wall-clock; TIMING=1: the timing run that sizes the arms, PILOT=1: its pilot -> results/curves_equal_cost{,_timing,_pilot}/
	$(PY) experiments/curves.py --protocol experiments/curves_protocol_equal_cost.yaml $(if $(TIMING),--timing,) $(if $(PILOT),--pilot,)

curves-window: $(STAMP) pretrain ## The equal-cost protocol's amendment 1 (experiments/curves_protocol_window.yaml, issue 56): window2 under the every-step noise, the window's regime over steps 0-9 through 2 and 4 knots, exact for 45 iterations, window2's cosine-0.8 control; resumes from results/curves_window/ (~10 CPU-hours; TIMING=1: the timing run that sizes the new arms) -> results/curves_window{,_timing}/
	$(PY) experiments/curves.py --protocol experiments/curves_protocol_window.yaml $(if $(TIMING),--timing --arms exact window2 window2_dance knots4_window_noise window10_knots2,)

curves-v3: $(STAMP) pretrain ## Protocol v3 as analysed (experiments/curves_protocol.yaml): DanceGRPO x exact / jagg / auto / endpoints / uniform / jagg_index / control 0.2 x 7 seeds (~45 min) -> results/curves/
	$(PY) experiments/curves.py

curves-long: $(STAMP) pretrain ## Protocol v3's long design: + Flow-GRPO-Fast, 12 paired seeds (~2 h) -> results/curves/
	$(PY) experiments/curves.py --long

judges-ood: $(STAMP) pretrain ## The three attribute judges on degradations none was trained on (~1 min) -> results/judges_ood.md
	$(PY) experiments/judges_ood.py

world-rl: $(STAMP) pretrain ## DanceGRPO + JAGG on the world, 180 iterations (~13 min): before/after -> results/world_rl_eval.md, paper_figures/world_rl_before_after.png
	@# The committed results came from the paper-literal update (joint endpoints, every step forwarded); these two
	@# overrides reproduce them bit for bit. The default (batched + stored outputs) is the same gradient up to
	@# float rounding and faster, but a 180-iteration run then drifts from the committed numbers at rounding level.
	$(PY) -m jagg.train --config configs/world/flux_dancegrpo.yaml --overwrite backward.graph_mode=joint backward.stored_outputs=false
	$(PY) experiments/world_rl_report.py --run runs/world/flux_dancegrpo --markdown results/world_rl_eval.md

figures: $(STAMP) ## Regenerate every table and figure from results/ alone (no training)
	$(PY) experiments/figures.py

notebooks: $(STAMP) ## Execute notebooks/*.ipynb in place from results/ (outputs + figures; walkthrough on the world backbone if pretrained, else random init)
	$(PY) experiments/run_notebooks.py

all: table1 cosine knots routing curves world-rl theorem bench figures notebooks ## Everything (pretraining included), then every figure and notebook
