"""The decoder stack as both phases call it: rows at their slots through a KV cache, and the caches kept.

`DecoderStack` is one part of `HunyuanT2IPipeline` (pipeline.py), shared by its AR and
denoise parts: `forward_rows` runs rows through the stack under the active phase's layout,
`_cache` hands out a KV cache from the pool kept between requests (`KVCachePool`, at fixed
addresses when compiling, so a CUDA-graph step records once), the release policy
(`kv_caches`) says when the pool gives its memory back, and `_check_budget` holds every
sequence to the model's positions. It reads the pipeline's `model`, `cfg`, `device`,
`kv_caches`, `_caches` (the pool) and `steps` (the compiled steps, whose CUDA-graph
recordings hold the caches' addresses).
"""
from __future__ import annotations

import torch

from dtgen.attention import AttentionMeta, KVCache, SlotRuns, slots_of_runs
from dtgen.seq_split import gather_output, split_input
from dtgen.sequence import SlotHole

# What the pipeline does with its KV caches between phases and requests (`kv_caches`):
# "keep" all of them, "release" each phase's when it ends, or "keep-ar": release the denoise
# caches (the largest) but keep the AR cache, whose CUDA-graph decode then records once.
KV_CACHE_POLICIES = ("keep", "release", "keep-ar")


class DecoderStack:
    def _release_phase_caches(self, roles: str) -> None:
        """kv_caches="release" (or "keep-ar" for the denoise caches): drop the kept caches whose
        role starts with `roles` ("ar", "denoise") and what was recorded over them, and hand
        the memory back."""
        if self.kv_caches == "keep" or (self.kv_caches == "keep-ar" and roles == "ar"):
            return
        self._caches.drop(roles)
        if roles == "ar":   # the decode steps' recordings hold the dropped cache's addresses
            self.steps.reset_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release_caches(self) -> None:
        """Drop the KV caches kept between requests (after an out-of-memory error: the next
        request allocates them again; a CUDA-graph decode step then records again)."""
        self._caches.clear()
        self.steps.reset_graphs()   # their recordings hold the old caches' addresses
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_budget(self, length: int, what: str) -> None:
        if length > self.cfg.max_position_embeddings:
            raise ValueError(f"{what} needs {length} positions; the model's max_position_embeddings is "
                             f"{self.cfg.max_position_embeddings}")

    # ---- shared step: run rows at given slots through the stack, gather them back -------
    def _cache(self, rt, batch: int, length: int, reuse: str | None = None) -> KVCache:
        """A zeroed static KV cache. `reuse`: a role ("ar", "denoise0", ...) whose buffers are
        kept and zeroed again by the next request of the same shape: compiled graphs see the
        same addresses every request, so a CUDA-graph step is recorded once, not per request."""
        cfg = self.cfg
        attn = self.model.model.layers[0].self_attn
        kv_local = attn.qkv_proj.weight.shape[0] // ((attn.group + 2) * attn.head_dim)
        kv = rt.cache_kv_heads(kv_local * attn.group, kv_local)
        length = length + rt.seq.spare_slots()
        return self._caches.get(cfg.num_hidden_layers, batch, kv, length, cfg.head_dim,
                                self.model.compute_dtype, self.device, role=reuse)

    def forward_rows(self, rt, embeds: torch.Tensor, rope_pos: torch.Tensor, slots: torch.Tensor | SlotRuns,
                     first_spare: int, image_blocks, cache: KVCache, hole: SlotHole | None = None) -> torch.Tensor:
        """embeds [B, n, H] at `slots` -> last hidden [B, n, H] (no ln_f), full rows on every rank.

        `slots`: a tensor [n] where they move every call (AR decode: one graph for all steps),
        or static runs ((start, end), ...) where they are fixed for the graph: then the
        attention runs mask-free pieces (`plan_segments`) on the fast kernels.
        `hole`: bucket padding inside the rows, hidden from every query (`DiffusionSequence`).
        `rope_pos` [n, 2], or [B, n, 2] with a per-row `hole`: batched requests of one bucket.
        """
        n = embeds.shape[1]
        runs = None
        if isinstance(slots, tuple):
            runs = rt.seq.pad_runs(slots, first_spare)
            slots = slots_of_runs(slots, self.device)
            if slots.shape[0] != n:
                raise ValueError(f"slot runs {runs} hold {slots.shape[0]} rows, but {n} rows are fed")
        meta = AttentionMeta(rt.seq.pad_slots(slots, first_spare), tuple(image_blocks), slot_runs=runs, hole=hole)
        layers = self.model.model
        h = layers(split_input(rt.seq, layers.seq_splits, "embeds", embeds),
                   split_input(rt.seq, layers.seq_splits, "rope_pos", rope_pos), meta, cache)
        return gather_output(rt.seq, layers.seq_splits, h, n)

    def _cache_rows(self, cache: KVCache, rows: torch.Tensor) -> KVCache:
        """The batch rows `rows` of a KV cache, as a new one (members left a batch)."""
        kept = cache.select_rows(rows)
        if self._caches.static_addresses:
            for layer in kept.layers:
                torch._dynamo.mark_static_address(layer.k)
                torch._dynamo.mark_static_address(layer.v)
        return kept
