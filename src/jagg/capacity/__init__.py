"""The capacity plan: what a run will cost before it runs (``python -m jagg.train --dry-run``).

``pass_plan`` (the trained steps per sample, their groups or knots, forward / backward passes and collectives
per graph mode, from the engine's cost model), ``memory_model`` (memory per GPU, host and disk) and
``dry_run`` (the report that joins them). Nothing here runs a model.

Layer: below the loop, above the run operations (``jagg.ops``); beside ``jagg.plugins``.
"""
