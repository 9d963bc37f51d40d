"""An image edit's condition: the reference image as the rows the Instruct template carries.

`EditCondition` is the edit part of `HunyuanT2IPipeline` (pipeline.py): it encodes the
reference once per request (the VAE half and the ViT half, `ConditionTokens`) and writes the
edit's Instruct prompt around it; the AR prompt and the denoise sequence then both splice the
rows in.
"""
from __future__ import annotations

import torch

from .cond_image import resize_and_crop, vae_bucket, vae_pixels
from .instruct import ConditionShape, ConditionTokens, InstructPrefix, instruct_prefix
from .model import HunyuanImage3ForCausalMM
from .requests import RequestRun, T2IRequest
from .resolutions import resolution_table
from .tokenizer import InstructTokens, SpecialTokens


class EditCondition:
    """Takes the model (its VAE encoder, vision tower and aligner, vision processor, and the
    image and timestep embedders that turn the latent into rows), the tokenizer (its Instruct
    tokens), the device and `vae_row_chunks` (the encode's convolutions over that many slabs
    of rows: `HunyuanVAE.encode`).

    In: a reference image (uint8 [H, W, 3]) and the request's seed (`encode_condition`), or a
    whole edit request, its run and its prompt's token ids (`prepare_edit`). Out: the
    condition rows (`ConditionTokens`), and with `prepare_edit` the edit's Instruct prompt
    (`InstructPrefix`); the run gets its condition_encode timing."""

    def __init__(self, model: HunyuanImage3ForCausalMM, tokenizer, device: torch.device, vae_row_chunks: int = 1):
        self.model, self.cfg, self.device = model, model.cfg, torch.device(device)
        self.tok = tokenizer
        self.special: SpecialTokens = tokenizer.special
        self.vae_row_chunks = vae_row_chunks

    def _instruct_tokens(self) -> InstructTokens:
        if self.tok.instruct is None:
            raise ValueError("image editing needs the Instruct template's special tokens (<think>, <recaption>, "
                             "<answer>, ...); this checkpoint's tokenizer has none")
        return self.tok.instruct

    def encode_condition(self, reference: torch.Tensor, seed: int) -> ConditionTokens:
        """uint8 [H, W, 3] -> the condition's rows: the VAE half (the image resized and cropped
        to its resolution bucket, encoded, a posterior SAMPLE drawn from a CPU generator seeded
        by `seed`, then patch-embedded at t = 0) and the ViT half (the original image in
        patches, the vision tower, the aligner; all rows, padding included)."""
        m, cfg, dev = self.model, self.cfg, self.device
        if m.vision_model is None or m.vae.encoder is None:
            raise ValueError("image editing needs the vision tower and the VAE encoder: load the model with "
                             "image_editing=True (--image does)")
        from PIL import Image
        bucket = vae_bucket(reference.shape[0], reference.shape[1], cfg.image_base_size)
        pixels = vae_pixels(resize_and_crop(Image.fromarray(reference.cpu().numpy()), bucket))
        latent = m.vae.encode(pixels.to(dev), torch.Generator().manual_seed(seed), self.vae_row_chunks).latent
        dtype = m.compute_dtype
        values, attention, spatial = m.vision_processor(reference.cpu())
        rows = m.vision_aligner(m.vision_model(values.to(dev, m.vision_dtype), attention.to(dev), spatial.to(dev)))
        grid_rows, grid_cols = (int(v) for v in spatial[0])
        shape = ConditionShape(resolution_table(cfg.image_base_size).index(bucket), latent.shape[-2],
                               latent.shape[-1], grid_rows, grid_cols, values.shape[1])
        zero = torch.zeros(1, device=dev)
        return ConditionTokens(shape, m.timestep_token(zero).unsqueeze(1).to(dtype),
                               m.image_tokens(latent.to(dtype), zero).to(dtype), rows.to(dtype), latent)

    def prepare_edit(self, req: T2IRequest, run: RequestRun,
                     prompt_ids: list[int]) -> tuple[InstructPrefix, ConditionTokens]:
        """An edit's Instruct prompt (around `prompt_ids`, the request's prompt as token ids) and
        its condition rows. The condition is computed once, here, on every rank (its modules
        are replicated, so every rank gets the same rows), and kept for the AR prompt and the
        denoise sequence: neither recomputed nor moved after the phase switch."""
        with run.profiler.phase("condition"), run.profiler.region("condition_encode"):
            t0 = run.timer.now()
            condition = self.encode_condition(req.reference, req.seed)
            run.timings["condition_encode"] = (run.timer.now() - t0) * 1e3
        return (instruct_prefix(self.tok.encode, self.special, self._instruct_tokens(), self.cfg.image_base_size,
                                condition.layout_shape, prompt_ids, req.system_prompt), condition)
