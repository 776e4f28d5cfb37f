"""The plug-ins of the training loop: instruments and controls that act at the update's touch points.

``jagg.plugins.base`` is the surface (``Plugin``, what a plug-in sees: ``UpdateView``); each other module is one
plug-in with its config keys beside it. ``PLUGINS`` is the registry, in the order the plug-ins act: a control
that changes the gradient comes before an instrument that measures it. A new instrument is one module here and
one line in ``PLUGINS``; the trainer does not change.

Layer: below the loop, beside ``jagg.capacity``; above ``jagg.config`` and the engine.
"""

from __future__ import annotations

from jagg.config import Config
from jagg.plugins.base import Plugin, RunView
from jagg.plugins.control import Control, StructuredControl
from jagg.plugins.eval_state import EvalState
from jagg.plugins.fidelity import Fidelity
from jagg.plugins.landing import Landing
from jagg.plugins.onpolicy import OnPolicy
from jagg.plugins.peak_memory import PeakMemory

PLUGINS: tuple[type[Plugin], ...] = (
    Control,
    StructuredControl,
    Fidelity,
    Landing,
    OnPolicy,
    EvalState,
    PeakMemory,
)


def build_plugins(cfg: Config, run: RunView) -> list[Plugin]:
    """The plug-ins ``cfg`` switches on, in ``PLUGINS`` order."""
    return [p for cls in PLUGINS if (p := cls.from_config(cfg, run)) is not None]
