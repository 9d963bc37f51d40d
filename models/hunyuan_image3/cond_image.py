"""Reference-image preprocessing for image editing (TI2I): the VAE half of the condition.

The official path (``HunyuanImage3ImageProcessor.get_image_with_size``): load the image as
RGB, pick the resolution bucket whose h/w is nearest the image's, resize it to cover the
bucket and crop the centre, then map uint8 to [-1, 1]. ``HunyuanVAE.encode`` takes it from
there. Pillow and torch only: every step here is reproduced bit-exactly, so the VAE sees the
same pixels as the official code.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Union

import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .resolutions import resolution_table

# Below one 16-px patch (the VAE's and the ViT's unit) there is nothing to condition on.
MIN_SIDE = 16
# Bounds the decode (8192^2 = 67 Mpx, under Pillow's 89 Mpx decompression-bomb warning); the
# model only ever sees the bucket, at most 2x the base size a side.
MAX_SIDE = 8192

# Modes whose convert("RGB") keeps the colours as displayed: grey, bilevel and palette images
# are expanded, RGBX drops padding, and alpha is DROPPED without compositing (what the
# official loader, transformers ``load_image``, does; matching it keeps the pixels identical).
# Rejected, though the official loader would take them: 16/32-bit integer and float modes
# (convert clips to 0..255 instead of rescaling, so a 16-bit image turns mostly white) and
# CMYK (converted by a naive formula that ignores the ICC profile, so colours shift).
RGB_CONVERTIBLE_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX")

PathLike = Union[str, Path]


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def load_reference_image(path: PathLike) -> Image.Image:
    """The image at ``path`` as RGB, upright (EXIF orientation applied, as the official loader).

    ValueError (one line, naming the path and the problem) for a missing or unreadable file,
    a mode outside ``RGB_CONVERTIBLE_MODES``, or a side outside [MIN_SIDE, MAX_SIDE].
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"reference image {path}: no such file")
    if not path.is_file():
        raise ValueError(f"reference image {path}: not a file")
    return _open_checked(path, f"reference image {path}")


def load_reference_bytes(data: bytes, name: str = "image") -> Image.Image:
    """An uploaded image (a server's edit request), with the checks of `load_reference_image`."""
    if not data:
        raise ValueError(f"{name}: the file is empty")
    return _open_checked(io.BytesIO(data), name)


def _open_checked(source, label: str) -> Image.Image:
    try:
        with Image.open(source) as image:
            # Size and mode come from the header: check them before decoding any pixel.
            width, height = image.size
            if min(width, height) < MIN_SIDE:
                raise ValueError(f"{label}: {width}x{height} (WxH) is too small, "
                                 f"each side must be at least MIN_SIDE={MIN_SIDE} px")
            if max(width, height) > MAX_SIDE:
                raise ValueError(f"{label}: {width}x{height} (WxH) is too large, "
                                 f"each side must be at most MAX_SIDE={MAX_SIDE} px")
            if image.mode not in RGB_CONVERTIBLE_MODES:
                raise ValueError(f"{label}: mode {image.mode!r} is not supported "
                                 f"(supported: {', '.join(RGB_CONVERTIBLE_MODES)}); convert it to 8-bit RGB first")
            image.load()
            return ImageOps.exif_transpose(image).convert("RGB")
    except Image.DecompressionBombError as err:
        raise ValueError(f"{label}: too large to decode safely "
                         f"(MAX_SIDE={MAX_SIDE} px): {_one_line(err)}") from None
    except UnidentifiedImageError:   # its message names the source: an upload's is a BytesIO's repr
        raise ValueError(f"{label}: not a readable image file (no image format PIL reads: PNG, JPEG, WebP, "
                         "...)") from None
    except (OSError, SyntaxError) as err:  # some plugins raise SyntaxError
        raise ValueError(f"{label}: not a readable image file ({_one_line(err)})") from None


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
