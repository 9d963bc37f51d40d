"""Shared pytest setup.

Triton kernels run on the CPU under TRITON_INTERPRET=1; the variable must be set before
triton is imported, so it is set here when no GPU is present. GPU-only tests carry the
`gpu` marker and are skipped without CUDA.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The embedded tiny default, written once per session into a private cache folder."""
    from models.hunyuan_image3.tiny import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("dtgen-cache"))
