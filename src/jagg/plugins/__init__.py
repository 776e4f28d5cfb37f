"""The plug-ins of the training loop: instruments and controls that act at the update's touch points.

``jagg.plugins.base`` is the surface (``Plugin``, what a plug-in sees: ``UpdateView``); each other module is one
plug-in with its config beside it (a ``PluginConfig``: the YAML section ``plugins.<name>``, its defaults and its
checks). ``PLUGINS`` is the registry, in the order the plug-ins act: a control that changes the gradient comes
before an instrument that measures it. A new instrument is one module here and one line in ``PLUGINS``: the
trainer, the config module and the checkpoint do not change (``jagg.config`` composes ``plugins:`` from here).

Layer: below ``jagg.config`` (which reads the plug-ins' configs from ``PLUGINS``), above the engine; a plug-in
gets the run's ``Config`` as an argument and never imports it.
"""

from __future__ import annotations

from jagg.plugins.base import Plugin, RunView
from jagg.plugins.control import Control, StructuredControl
from jagg.plugins.eval_state import EvalState
from jagg.plugins.fidelity import Fidelity
from jagg.plugins.grad_norm import GradNorm
from jagg.plugins.landing import Landing
from jagg.plugins.onpolicy import OnPolicy
from jagg.plugins.peak_memory import PeakMemory

PLUGINS: tuple[type[Plugin], ...] = (
    Control,
    StructuredControl,
    GradNorm,
    Fidelity,
    Landing,
    OnPolicy,
    EvalState,
    PeakMemory,
)


def build_plugins(cfg, run: RunView) -> list[Plugin]:
    """The plug-ins ``cfg`` (the run's ``jagg.config.Config``) switches on, in ``PLUGINS`` order."""
    return [p for cls in PLUGINS if (p := cls.from_config(cfg, run)) is not None]
