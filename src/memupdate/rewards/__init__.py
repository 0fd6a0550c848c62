"""Rewards: pure functions that return their components (``{"score": ..., ...}``)."""
