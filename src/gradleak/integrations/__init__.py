"""Integrations with FL frameworks (optional extras)."""
