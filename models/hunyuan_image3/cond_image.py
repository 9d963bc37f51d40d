"""Reference-image preprocessing for image editing (TI2I): the VAE half of the condition.

The official path (``HunyuanImage3ImageProcessor.get_image_with_size``): load the image as
RGB, pick the resolution bucket whose h/w is nearest the image's, resize it to cover the
bucket and crop the centre, then map uint8 to [-1, 1]. ``HunyuanVAE.encode`` takes it from
there. Pillow and torch only: every step here is reproduced bit-exactly, so the VAE sees the
same pixels as the official code.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch
from PIL import Image

from dtgen.reference_images import open_image_bytes, open_image_file

from .resolutions import resolution_table

# Below one 16-px patch (the VAE's and the ViT's unit) there is nothing to condition on.
MIN_SIDE = 16
# Bounds the decode (8192^2 = 67 Mpx, under Pillow's 89 Mpx decompression-bomb warning); the
# model only ever sees the bucket, at most 2x the base size a side.
MAX_SIDE = 8192

PathLike = Union[str, Path]


def load_reference_image(path: PathLike) -> Image.Image:
    """The image at ``path`` as RGB, upright (EXIF orientation applied, as the official loader).

    ValueError (one line, naming the path and the problem) for a missing or unreadable file,
    a mode RGB conversion would change, or a side outside [MIN_SIDE, MAX_SIDE]
    (dtgen/reference_images.py).
    """
    return open_image_file(path, MIN_SIDE, MAX_SIDE)


def load_reference_bytes(data: bytes, name: str = "image") -> Image.Image:
    """An uploaded image (a server's edit request), with the checks of `load_reference_image`."""
    return open_image_bytes(data, name, MIN_SIDE, MAX_SIDE)


def vae_bucket(height: int, width: int, base_size: int) -> tuple[int, int]:
    """(h, w) of the bucket of ``resolution_table(base_size)`` whose h/w is nearest height/width.

    Ties go to the first such entry of the table (the lower h/w), as the official
    ``ResolutionGroup.get_target_size`` (np.argmin) does.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width} (HxW)")
    ratio = height / width
    table = resolution_table(base_size)
    return min(table, key=lambda hw: abs(hw[0] / hw[1] - ratio))


def resize_and_crop(image: Image.Image, bucket_hw: tuple[int, int]) -> Image.Image:
    """Resize (LANCZOS, aspect kept) so that the bucket is covered, then crop its centre; the
    official ``resize_and_crop(crop_type="center")``, including its round() calls."""
    th, tw = bucket_hw
    w, h = image.size
    if h / w < th / tw:
        resize_h, resize_w = th, int(round(th / h * w))
    else:
        resize_h, resize_w = int(round(tw / w * h)), tw
    image = image.resize((resize_w, resize_h), resample=Image.Resampling.LANCZOS)
    top = int(round((resize_h - th) / 2.0))
    left = int(round((resize_w - tw) / 2.0))
    return image.crop((left, top, left + tw, top + th))


def vae_pixels(image: Image.Image) -> torch.Tensor:
    """RGB image -> [1, 3, H, W] float32 in [-1, 1]: (u8/255 - 0.5)/0.5, the official
    ToTensor + Normalize(0.5, 0.5) in the same order of operations (bit-exact)."""
    if image.mode != "RGB":
        raise ValueError(f"vae_pixels needs an RGB image, got mode {image.mode!r}")
    w, h = image.size
    u8 = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(h, w, 3)
    return ((u8.permute(2, 0, 1).float() / 255 - 0.5) / 0.5).unsqueeze(0)


def reference_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB image as the pipeline takes it: uint8 [H, W, 3]."""
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(image.height, image.width, 3)
