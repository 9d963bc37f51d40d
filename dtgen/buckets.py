"""The shapes a model buckets, declared on its spec (`ModelSpec.buckets`, dtgen/registry.py).

A model's compiled steps are made for the shapes of their tensors: the output's size (an
image's height and width, a video's frames too) and, where a prompt's rows sit in the
sequence, its length. A model that pads the prompt to a multiple of some rows puts prompts of
many lengths in one bucket (HunyuanImage-3: `--prompt-bucket`, 256 by default under compile).
`ShapeBuckets` says which request fields are the bucket, as data; `key` is a request's
bucket (and, where the model batches, what its batch must share), and `pad_rows` the one
formula for a bucket's rows. Plain data: reading a spec imports nothing of the model.
"""
from __future__ import annotations

from dataclasses import dataclass


def pad_rows(n: int, multiple: int, limit: int | None = None) -> int:
    """The rows n real rows take in their bucket: n rounded up to a multiple of `multiple`
    (0: not bucketed, n), no further than `limit` (the model's positions), never below n."""
    if not multiple:
        return n
    padded = -(-n // multiple) * multiple
    return padded if limit is None else max(n, min(padded, limit))


@dataclass(frozen=True)
class ShapeBuckets:
    """sizes: the request fields that set the size of the steps' tensors, each value its own
        bucket: ("image_size",) (HunyuanImage-3: the sizes of its resolution table),
        ("num_frames", "height", "width") (Wan: any its request's check takes).
    text_rows: the prompt's rows pad to a multiple of this many under torch.compile (a run
        may set another); 0: the prompt is not padded to a bucket.
    batch: what requests must share, beyond their bucket, to run their denoise steps as rows
        of one batch (the schedule, the guidance mode, the step cache): attributes of the
        request, its fields or properties read off them (Wan's `guided`: which experts' steps
        run CFG); empty: the model runs one request at a time (the server refuses
        --max-batch > 1).
    """

    sizes: tuple[str, ...]
    text_rows: int = 0
    batch: tuple[str, ...] = ()

    def fields(self, text_rows: bool = False) -> tuple[str, ...]:
        """What each place of `key` holds: the size fields, "text_rows" (when counted), the batch fields."""
        return (*self.sizes, *(("text_rows",) if text_rows else ()), *self.batch)

    def key(self, request, text_rows: int | None = None) -> tuple:
        """`request`'s bucket: its size fields, its prompt's bucketed rows (when given: the
        model's text is bucketed and the caller counted them), then the fields of `batch`."""
        rows = () if text_rows is None else (text_rows,)
        return (*(getattr(request, f) for f in self.sizes), *rows, *(getattr(request, f) for f in self.batch))
