"""JAGG inside the engines practitioners train with (docs/engine.md, "JAGG in your engine").

``accelerate_backward`` routes a ``BackwardSetting``'s backward calls through an accelerate ``Accelerator`` (its
loss scaling, gradient-accumulation division and DeepSpeed hooks see them). ``jagg.integrations.unirl`` (a UniRL
``FlowGRPO`` subclass) and ``jagg.integrations.flow_factory`` (a Flow-Factory ``GRPOTrainer`` subclass) import
their engine when imported, so they are not imported here.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from jagg.engine.strategies import BackwardFn


def surrogate(tensors: Sequence[Tensor], grads: Sequence[Tensor]) -> Tensor:
    """The scalar sum_k <t_k, g_k> (g_k detached): its gradient is sum_k J_k^T g_k, what
    ``torch.autograd.backward(tensors, grads)`` adds, for engines whose backward takes one scalar loss."""
    return sum((t * g.detach()).sum() for t, g in zip(tensors, grads, strict=True))


def accelerate_backward(accelerator) -> BackwardFn:
    """``backward_fn`` that hands each backward call to ``accelerator.backward`` as one scalar (``surrogate``):
    accelerate divides it by ``gradient_accumulation_steps`` and scales it by its ``GradScaler`` (fp16) or runs
    DeepSpeed's backward, exactly as it does for the engine's own loss.

    Follows accelerate ``Accelerator.backward`` (v1.15.0, src/accelerate/accelerator.py)."""

    def backward(tensors: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        accelerator.backward(surrogate(tensors, grads))

    return backward


__all__ = ["accelerate_backward", "surrogate"]
