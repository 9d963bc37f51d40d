"""The decoder stack as both phases call it: rows at their slots through a KV cache, and the caches kept.

`DecoderStack` is the part of `HunyuanT2IPipeline` (pipeline.py) that the AR phase (ar.py)
and the denoise phase (denoise.py) share: `forward_rows` runs rows through the model's
decoder under the active phase's layout, `cache` hands out a KV cache from the pool kept
between requests (`KVCachePool`, at fixed addresses when compiling, so a CUDA-graph step
records once), the release policy (`kv_caches`) says when the pool gives its memory back,
and `check_budget` holds every sequence to the model's positions.
"""
from __future__ import annotations

import torch

from dtgen.attention import AttentionMeta, KVCache, KVCachePool, SlotRuns, slots_of_runs
from dtgen.compiled_steps import CompiledSteps
from dtgen.requests import RequestError
from dtgen.seq_split import gather_output, split_input
from dtgen.sequence import SlotHole

from .model import HunyuanImage3ForCausalMM
from .transformer import run_layer

# What the pipeline does with its KV caches between phases and requests (`kv_caches`):
# "keep" all of them, "release" each phase's when it ends, or "keep-ar": release the denoise
# caches (the largest) but keep the AR cache, whose CUDA-graph decode then records once.
KV_CACHE_POLICIES = ("keep", "release", "keep-ar")


class DecoderStack:
    """Takes the model (its decoder layers and config), the device, the pipeline's compiled
    steps (a release resets their CUDA-graph recordings, which hold the dropped caches'
    addresses; in regions mode the decoder's layer is compiled here, as the region every
    step runs around) and the cache policy `kv_caches` (KV_CACHE_POLICIES).

    Gives `forward_rows` (embeds at slots -> last hidden rows), `cache` / `cache_rows` (KV
    caches from the kept pool, `cache_pool`), `release_phase` / `release` (the policy's and
    an out-of-memory error's releases) and `check_budget` (a sequence against the model's
    positions)."""

    def __init__(self, model: HunyuanImage3ForCausalMM, device: torch.device, steps: CompiledSteps,
                 kv_caches: str = "keep"):
        if kv_caches not in KV_CACHE_POLICIES:
            raise ValueError(f"kv_caches must be one of {KV_CACHE_POLICIES}, got {kv_caches!r}")
        self.model = model
        self.cfg = model.cfg
        self.device = torch.device(device)
        self.steps = steps
        self.kv_caches = kv_caches
        self.cache_pool = KVCachePool(static_addresses=steps.compiler.options.enabled)
        if steps.regions:
            # One compiled region per decoder layer, shared by all of them; every step runs
            # eagerly around it, so dynamo traces one layer whatever the depth. The decode
            # step's eager code costs more host time than one token's GPU work, so on CUDA it
            # is recorded as a CUDA graph around the regions (dtgen/cuda_graph.py).
            model.model.run_layer = steps.region(run_layer)

    def release_phase(self, roles: str) -> None:
        """kv_caches="release" (or "keep-ar" for the denoise caches): drop the kept caches whose
        role starts with `roles` ("ar", "denoise") and what was recorded over them, and hand
        the memory back."""
        if self.kv_caches == "keep" or (self.kv_caches == "keep-ar" and roles == "ar"):
            return
        self.cache_pool.drop(roles)
        if roles == "ar":   # the decode steps' recordings hold the dropped cache's addresses
            self.steps.reset_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release(self) -> None:
        """Drop the KV caches kept between requests (after an out-of-memory error: the next
        request allocates them again; a CUDA-graph decode step then records again)."""
        self.cache_pool.clear()
        self.steps.reset_graphs()   # their recordings hold the old caches' addresses
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def check_budget(self, length: int, what: str, field: str | None = None) -> None:
        """`field`: the request's field to name (a `RequestError`: the CLI's one line, the
        server's 422), where a request's own content made the sequence too long."""
        if length > self.cfg.max_position_embeddings:
            message = f"{what} needs {length} positions; the model's max_position_embeddings is " \
                      f"{self.cfg.max_position_embeddings}"
            raise ValueError(message) if field is None else RequestError(field, message)

    # ---- shared step: run rows at given slots through the stack, gather them back -------
    def cache(self, rt, batch: int, length: int, reuse: str | None = None) -> KVCache:
        """A zeroed static KV cache. `reuse`: a role ("ar", "denoise0", ...) whose buffers are
        kept and zeroed again by the next request of the same shape: compiled graphs see the
        same addresses every request, so a CUDA-graph step is recorded once, not per request."""
        cfg = self.cfg
        attn = self.model.model.layers[0].self_attn
        kv_local = attn.qkv_proj.weight.shape[0] // ((attn.group + 2) * attn.head_dim)
        kv = rt.cache_kv_heads(kv_local * attn.group, kv_local)
        length = length + rt.seq.spare_slots()
        return self.cache_pool.get(cfg.num_hidden_layers, batch, kv, length, cfg.head_dim,
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

    def cache_rows(self, cache: KVCache, rows: torch.Tensor) -> KVCache:
        """The batch rows `rows` of a KV cache, as a new one (members left a batch)."""
        kept = cache.select_rows(rows)
        if self.cache_pool.static_addresses:
            for layer in kept.layers:
                torch._dynamo.mark_static_address(layer.k)
                torch._dynamo.mark_static_address(layer.v)
        return kept
