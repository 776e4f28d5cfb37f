"""Run operations: what keeps a run safe and visible, apart from what it trains.

``checkpoint`` (sharded DCP checkpoints, verified, written atomically, optionally in the background), ``rundir``
(the run directory's marker, its one-writer lock, what ``--overwrite`` may delete), ``preflight`` (the CLI's
checks before any model code is imported), ``node`` (the target node: CUDA build, driver, NCCL, GPUs),
``heartbeat`` (per-phase heartbeats and hang stacks), ``signals`` (a preemption's signal becomes a stop with a
checkpoint), ``trackers`` (TensorBoard / wandb, and ``RunLog``: metrics.jsonl and evaluation samples) and
``grids`` (PNG sample grids). docs/architecture.md lists what each holds.

Layer: below the loop and the capacity plan, above ``jagg.world`` / ``jagg.scale``; it never imports the loop.
"""
