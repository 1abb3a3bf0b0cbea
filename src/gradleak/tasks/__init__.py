"""Tasks and the client's local training.

A task (:mod:`.base`) is what a model trains on and how it is scored: image classification, text
classification, causal language modelling. :mod:`.client` is the client's one local training run (FedSGD or
FedAvg under its defenses), :mod:`.text_client` the transformer fine-tuning steps that paper 002's
protocols and benchmarks drive directly.
"""

from gradleak.tasks.base import (
    IMAGE_CLASSIFICATION,
    TEXT_TASK_OF_MODEL,
    CausalLM,
    Dataset,
    ImageClassification,
    Task,
    TextClassification,
    task_from_spec,
    task_spec,
    text_loss,
)

__all__ = [
    "IMAGE_CLASSIFICATION", "TEXT_TASK_OF_MODEL", "CausalLM", "Dataset", "ImageClassification",
    "Task",
    "TextClassification", "task_from_spec", "task_spec", "text_loss",
]  # fmt: skip
