"""Wan 2.1 / 2.2 text-to-video: the DiT, VAE, text encoder and schedulers as plain modules."""
