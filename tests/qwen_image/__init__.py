"""Qwen-Image: the model against diffusers, its plans, its example and server."""
