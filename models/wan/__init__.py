"""Wan 2.1 / 2.2 text-to-video: the DiT as plain modules, its adapter, pipeline and tiny default (UMT5 and the VAE are dtgen/layers)."""
