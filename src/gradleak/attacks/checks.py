"""Checks an image attack runs on its Observation before any work (clear errors instead of raw torch ones)."""

from __future__ import annotations

import torch

from gradleak.types import AttackInputError, Observation


def require_image_input(obs: Observation) -> None:
    """The model must map ``(1, *input_shape)`` images to ``(1, num_classes)`` logits.

    A wrong ``input_shape`` (or ``num_classes``) then fails here with :class:`AttackInputError` naming the
    shapes, not deep inside an optimisation loop with a convolution error. One forward pass in eval mode
    without gradients; the model's mode is restored.
    """
    shape = tuple(obs.input_shape)
    if len(shape) != 3:
        raise AttackInputError(f"an image attack needs input_shape (C, H, W), got {shape}")
    model = obs.model
    first = next(model.parameters(), None)
    dtype = torch.float32 if first is None else first.dtype
    device = torch.device("cpu") if first is None else first.device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(1, *shape, dtype=dtype, device=device))
    except (RuntimeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise AttackInputError(f"the model does not accept images of input_shape {shape}: {reason}") from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, obs.num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise AttackInputError(
            f"the model maps input_shape {shape} to {got}, not to (1, num_classes={obs.num_classes})"
        )
