"""The resolution table of HunyuanImage-3.0: the image sizes a base size allows, index k <-> `<img_ratio_k>`."""
from __future__ import annotations

from dtgen.requests import split_size


# Added after the grid when their ratio is missing from it; the official code adds them as
# they are, whatever the base size.
_EXTRA_RESOLUTIONS = ((1024, 768), (1280, 720), (768, 1024), (720, 1280))


def resolution_table(base: int, align: int = 16) -> list[tuple[int, int]]:
    """The official (height, width) table, index k <-> `<img_ratio_k>`.

    From base x base, step base/16 in opposite directions until one side is base/2 and the
    other 2*base (16 sizes each way), sorted by h/w; then the four extra resolutions whose
    ratios the grid lacks, unscaled at every base (as the official `ResolutionGroup`).
    """
    step = base // 16
    lo, hi = base // 2, base * 2
    sizes = [(base, base)]
    for grow_h in (True, False):
        h = w = base
        while not ((h >= hi and w <= lo) if grow_h else (h <= lo and w >= hi)):
            h, w = (min(h + step, hi), max(w - step, lo)) if grow_h else (max(h - step, lo), min(w + step, hi))
            sizes.append((h // align * align, w // align * align))
    sizes.sort(key=lambda s: s[0] / s[1])
    ratios = {s[0] / s[1] for s in sizes}
    for h, w in _EXTRA_RESOLUTIONS:
        if h / w not in ratios:
            sizes.append((h // align * align, w // align * align))
    return sizes


def parse_image_size(text: str, base: int) -> int | None:
    """'auto' -> None (the model picks), 'HxW' -> its index in the resolution table."""
    if text == "auto":
        return None
    table = resolution_table(base)
    size = split_size(text)
    if size is None:
        raise ValueError(f"image size {text!r} is not 'auto' or 'HxW' (e.g. {base}x{base})")
    h, w = size
    if (h, w) in table:
        return table.index((h, w))
    near = sorted(table, key=lambda s: abs(s[0] / s[1] - h / w))[:3]
    raise ValueError(f"image size {h}x{w} is not in the resolution table for base size {base}; "
                     f"nearest ratios: {', '.join(f'{a}x{b}' for a, b in near)}")
