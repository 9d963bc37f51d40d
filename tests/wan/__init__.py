"""Wan 2.1 text-to-video: the model, its plans and step caches, its example and server."""
