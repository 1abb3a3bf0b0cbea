"""Where gradleak computes: one device for a run, named by ``experiment.device`` (``"cpu"``, ``"cuda"``,
``"cuda:1"``), checked before any work.

The rule the engine follows, so that a run gives the same records on every device up to floating-point
rounding:

- **at rest on the CPU**: data sets, updates between client and server, reconstructions, records and stores
  (what crosses a process or a file is host memory);
- **computed on the device**: the global model, a client's training (``Task.loss`` moves each batch to the
  model's device: :func:`module_device`), the defenses in its loop, an attack's optimisation and the model it
  differentiates (:meth:`gradleak.types.Observation.to`);
- **drawn on the CPU**: every random draw comes from a CPU :class:`torch.Generator` and is moved to where it
  is used (:func:`normal`), so a seed gives the same draws on any device. (GPU kernels still round
  differently, and some backward kernels add atomically, so GPU results match the CPU's to rounding, not
  bit for bit.)

Nothing in ``src/`` names a GPU itself (``tests/test_device.py`` checks the source): the device comes
from the config or from the tensors at hand.
"""

from __future__ import annotations

import torch
from torch import nn

DEVICE_TYPES = ("cpu", "cuda")  # what experiment.device may name; "cuda:1" is a GPU of several
CPU = torch.device("cpu")


class DeviceError(ValueError):
    """A device that is malformed, or absent on this machine."""


def parse_device(name: object, key: str = "device") -> torch.device:
    """``name`` as a torch device of a supported type (:data:`DEVICE_TYPES`), or :class:`DeviceError`
    naming ``key``. Syntax only: whether this machine has it is :func:`usable_device`."""
    try:
        device = torch.device(name.strip()) if isinstance(name, str) else None
    except RuntimeError:
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise DeviceError(f"{key} must be 'cpu', 'cuda' or 'cuda:<index>', got {name!r}")
    return device


def usable_device(name: object, key: str = "device") -> torch.device:
    """``name`` parsed (:func:`parse_device`) and present on this machine, else :class:`DeviceError`
    saying what is here; called before any work, so a run meant for a GPU never starts on the CPU."""
    device = parse_device(name, key)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"{key} {name!r}: torch sees no CUDA device on this machine; use 'cpu'")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"{key} {name!r}: this machine has {count} CUDA device(s), 0 to {count - 1}")
    return device


def module_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter or buffer (the CPU for a module with neither)."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return CPU


def generator_on(device: torch.device, base: torch.Generator) -> torch.Generator:
    """A generator on ``device`` for a library that draws where its tensors are (Opacus' noise): ``base``
    itself when it is there, else a new one seeded by one draw from ``base``; reproducible per device."""
    if base.device.type == device.type and base.device.index in (None, device.index):
        return base
    seed = int(torch.randint(0, 2**62, (1,), generator=base, device=base.device))
    return torch.Generator(device=device).manual_seed(seed)


def normal(
    shape: tuple[int, ...] | torch.Size,
    generator: torch.Generator,
    like: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Standard normal draws of ``shape`` in ``dtype`` from the (CPU) ``generator``, then on ``like``'s
    device and dtype: the same numbers on every device."""
    return torch.randn(shape, generator=generator, dtype=dtype, device=generator.device).to(like)


def uniform(
    shape: tuple[int, ...] | torch.Size,
    generator: torch.Generator,
    like: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Uniform [0, 1) draws, as :func:`normal`."""
    return torch.rand(shape, generator=generator, dtype=dtype, device=generator.device).to(like)
