"""The docs' tiny DiT (docs/placements.md, "Adding a model"): the framework's tests run on it."""
