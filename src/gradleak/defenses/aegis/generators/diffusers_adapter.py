"""Adapter from a local diffusers text-to-image pipeline to a :class:`ConditionalGenerator`.

Paper 000's default generator is Stable Diffusion 2.0 (OpenCLIP ViT-H/14), prompted from locally visible
labels without dataset-specific fine-tuning (Appendix F.1). This adapter loads a pipeline saved in a local
folder (``DiffusionPipeline.from_pretrained(path, local_files_only=True)``), prompts it with one text per
class, and aligns the output with the task (size, channels, [0, 1]) through
:func:`gradleak.defenses.aegis.generators.base.align_images`. ``diffusers`` is imported only when the adapter
is built; it is not a gradleak dependency, and the tests do not exercise this module (no weights, no GPU
offline).
See docs/defenses.md for usage.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from gradleak.defenses.aegis.generators.base import align_images, check_labels


class DiffusersGenerator:
    """``prompts[y]`` is the text for class ``y``, e.g. "a CT slice of the liver, grayscale"."""

    def __init__(
        self,
        path: str,
        prompts: Sequence[str],
        image_shape: tuple[int, int, int],
        *,
        device: str = "cuda",
        steps: int = 25,
        guidance: float = 7.5,
        batch_size: int = 8,
        pipeline_kwargs: dict[str, Any] | None = None,
    ) -> None:
        try:
            diffusers = importlib.import_module("diffusers")
        except ImportError as exc:  # pragma: no cover - optional dependency
            raise ImportError(
                "DiffusersGenerator needs the 'diffusers' package (pip install diffusers)"
            ) from exc
        if not prompts:
            raise ValueError("prompts must name at least one class")
        self.pipe = diffusers.DiffusionPipeline.from_pretrained(
            path, local_files_only=True, **(pipeline_kwargs or {})
        ).to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.prompts = list(prompts)
        self.image_shape = image_shape
        self.num_classes = len(self.prompts)
        self.device, self.steps, self.guidance, self.batch_size = device, steps, guidance, batch_size

    def sample(self, labels: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:  # pragma: no cover
        check_labels(labels, self.num_classes)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        dev_gen = torch.Generator(device=self.device).manual_seed(seed)
        chunks = []
        for part in labels.split(self.batch_size):
            out = self.pipe(
                [self.prompts[int(y)] for y in part], num_inference_steps=self.steps,
                guidance_scale=self.guidance, generator=dev_gen, output_type="pt",
            )  # fmt: skip
            chunks.append(align_images(out.images.float().cpu(), self.image_shape))
        return torch.cat(chunks)
