"""gradleak: measure and stop gradient leakage in federated learning."""

__version__ = "0.1.0"
