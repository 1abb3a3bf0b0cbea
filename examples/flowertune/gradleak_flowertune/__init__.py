"""A FlowerTune-shaped app: federated LoRA fine-tuning with gradleak's defense and audit."""
