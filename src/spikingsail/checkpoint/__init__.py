"""Checkpoints: crash-safe directories, and what an engine saves in them."""
