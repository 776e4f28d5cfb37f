"""The training loop and its composition root: the top layer, with the CLI ``jagg.train``.

The loop (``Trainer``: rollout -> calibrate -> update -> evaluate -> fit) and what it is built from: the model
source and the rewards of a run, where the trained model lives, its optimizer, checkpoint state, export, sample
grids, the ``--dry-run`` report (pass plan, memory model), the node preflight, per-phase heartbeats, and
side-by-side timing for the drivers. docs/architecture.md lists the modules.

Layer: top; it may import every other layer. Nothing in ``jagg`` imports it except ``jagg.train``.
"""
