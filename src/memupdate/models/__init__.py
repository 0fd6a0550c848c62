"""Model artifacts for training and serving: checkpoint preparation and chat templates."""
