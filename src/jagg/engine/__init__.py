"""The engine: the method itself, independent of any model, reward or run.

The SDE step and its log-prob, the per-step GRPO loss, the backward of a group of steps (exact, JAGG, the
ablations), the routing of a trajectory's groups and its cost, gradient diagnostics, the positive control,
sampling, and which steps
each algorithm trains. docs/architecture.md lists the modules and what each holds.

Layer: beside ``jagg.models`` and ``jagg.rewards`` (none of the three imports another); from the package it
may import only ``jagg.errors`` and ``jagg.common``. The public entry points are re-exported by ``jagg``.
"""
