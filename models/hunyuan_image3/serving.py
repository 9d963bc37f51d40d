"""HunyuanImage-3 text-to-image and image editing behind `dtgen.serve`: the adapter a server plugs in.

Request fields (JSON, or form text on the edits route), OpenAI's first:
- `prompt` (required), `n` (1), `size` ("auto" or "WIDTHxHEIGHT", one of the model's
  sizes: the same convention as the CLI's --image-size and the UI), `response_format`
  ("b64_json"), `model` and `user` (accepted, ignored); `output_format` and
  `output_compression` are the server's (dtgen.serve.adapters.take_image_output);
- the model's own: `seed`, `num_inference_steps`, `guidance_scale`, `max_new_tokens`,
  `step_cache` (fewer full denoise steps: "taylor", "taylor:interval=5,order=2", or
  {"method": "taylor", "interval": 5, ...}; `taylorseer` too; null: every step in full), and
  on the edits route `system_prompt`; the edit's `image` is a file (one), `mask` is refused.
Fields not given take the server's defaults (the T2I example's flags). Any other field is
refused by name. Validation is `T2IRequest.check` (the CLI's own) with the position budget
of the whole request, before the job is queued.

A new `T2IRequest` field reaches requests with its declaration in the request
(models/hunyuan_image3/requests.py, dtgen/schema.py): its JSON name, type and bounds;
nothing else here.
"""
from __future__ import annotations

from dataclasses import replace

from dtgen.batching import per_member
from dtgen.buckets import pad_rows
from dtgen.compile import unique_graphs
from dtgen.requests import check_image_fields
from dtgen.schema import OPENAI_IMAGE_FIELDS
from dtgen.requests import RequestError
from dtgen.serve.fields import FieldTable
from models.hunyuan_image3.cond_image import load_reference_bytes, reference_tensor, vae_bucket
from models.hunyuan_image3.instruct import ConditionShape, instruct_prefix
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline, to_uint8
from models.hunyuan_image3.requests import Limits, T2IRequest, filler_ids, hw_to_size, size_to_hw, warmup_request
from models.hunyuan_image3.resolutions import resolution_table
from models.hunyuan_image3.spec import BUCKETS


# The request's declared fields with a JSON name (T2IRequest) and OpenAI's that the adapter reads itself.
FIELDS = FieldTable(T2IRequest, OPENAI_IMAGE_FIELDS)


class HunyuanServeAdapter:
    """`defaults`: the request every field not given comes from. `warmup_shapes`: (prompt
    tokens, "HxW") to compile ahead of traffic (`pipe.warm_up`); None warms up with one
    short request of the defaults' shape."""

    kind = "image"
    name = "HunyuanImage-3"

    def __init__(self, pipe: HunyuanT2IPipeline, rank: int, defaults: T2IRequest,
                 warmup_shapes: list[tuple[int, str]] | None = None, warmup: bool = True,
                 warmup_batch: int = 1):
        self.pipe, self.rank, self.defaults = pipe, rank, defaults
        self.warmup_shapes, self.warmup = warmup_shapes, warmup
        self.warmup_batch = warmup_batch   # a compiled pipeline also warms up batches of 2..warmup_batch
        m = pipe.model
        self.edit_problem = ("the model was loaded without the vision tower and the VAE encoder (the checkpoint "
                             "has none, or --no-edits)" if m.vision_model is None or m.vae.encoder is None else
                             "the tokenizer has no Instruct tokens" if pipe.tok.instruct is None else None)
        self.can_edit = self.edit_problem is None

    @property
    def loras(self):
        """The pipeline's resident LoRA adapters (`dtgen.lora.ResidentLoras`): POST /v1/loras loads
        into it on every rank; a request's `loras` names them."""
        return self.pipe.loras

    def defaults_dict(self) -> dict:
        defaults = FIELDS.defaults(self.defaults)
        # the request holds the pipeline's "HxW"; a user reads and gives WIDTHxHEIGHT
        return {**defaults, "size": hw_to_size(defaults["size"]),
                "sizes": [f"{w}x{h}" for h, w in resolution_table(self.pipe.cfg.image_base_size)]}

    # ---- rank 0: fields -> request ----------------------------------------------------
    def _values(self, fields: dict, route: str) -> dict:
        check_image_fields(fields, FIELDS.names(route))
        FIELDS.check_types(fields)
        # a step cache: "taylor:interval=5" or {"method": "taylor", "interval": 5}; null: no cache
        values = FIELDS.values(fields)
        if "image_size" in values:
            values["image_size"] = size_to_hw(values["image_size"], "size", self.pipe.cfg.image_base_size)
        return values

    def _check(self, req: T2IRequest, prefix=None) -> T2IRequest:
        return FIELDS.checked(req, Limits.of(self.pipe.cfg, self.pipe.tok), edit_prefix=prefix)

    def parse(self, fields: dict, form: bool = False) -> T2IRequest:
        return self._check(replace(self.defaults, **self._values(FIELDS.read(fields, form), "generations")))

    def parse_edit(self, fields: dict, files: dict, form: bool = True) -> T2IRequest:
        """An edit: the form's fields and its one `image` file (OpenAI's `image` or `image[]`)."""
        if "mask" in files or "mask" in fields:
            raise RequestError("mask", "not supported: the edit covers the whole image (HunyuanImage-3 takes no mask)")
        other = sorted(set(files) - {"image", "image[]"})
        if other:
            raise RequestError(other[0], "unknown file field; an edit takes one `image` file")
        images = files.get("image", []) + files.get("image[]", [])
        if not images:
            raise RequestError("image", "is required: the image to edit, as a file field of the form")
        if len(images) > 1:
            raise RequestError("image", f"one image per edit, got {len(images)}")
        if "image" in fields or "image[]" in fields:
            raise RequestError("image", "must be a file, not text")
        filename, data = images[0]
        try:
            reference = reference_tensor(load_reference_bytes(data, filename or "image"))
        except ValueError as e:
            raise RequestError("image", str(e)) from None
        values = self._values(FIELDS.read(fields, form), "edits")
        req = replace(self.defaults, **values, reference=reference)
        m, cfg = self.pipe.model, self.pipe.cfg
        base = cfg.image_base_size
        bucket = vae_bucket(reference.shape[0], reference.shape[1], base)
        down = cfg.vae_downsample_factor
        _, _, spatial = m.vision_processor(reference)
        vit_rows, vit_cols = (int(v) for v in spatial[0])
        shape = ConditionShape(resolution_table(base).index(bucket), bucket[0] // down[0], bucket[1] // down[1],
                               vit_rows, vit_cols, m.vision_processor.max_num_patches)
        tok = self.pipe.tok
        return self._check(req, prefix=lambda ids: instruct_prefix(tok.encode, tok.special, tok.instruct, base,
                                                                   shape, ids, req.system_prompt))

    def phases(self, req: T2IRequest) -> tuple[str, ...]:
        return (("condition",) if req.reference is not None else ()) + ("ar", "denoise", "vae")

    # ---- every rank -------------------------------------------------------------------
    def generate(self, req: T2IRequest, progress) -> dict | None:
        graphs = unique_graphs()
        progress.show(*self._first_phase(req))

        def hook(phase: str, done: int, total: int) -> None:
            if phase == "vae":       # only the ranks that decode report it: no agreement there
                return progress.show(phase, done, total)
            progress(phase, done, total)
            if phase == "denoise" and done == total:
                progress.show("vae", 0, 1)

        result = self.pipe.generate(req, progress=hook)
        return self._answer(req, result, unique_graphs() - graphs)

    # ---- batches: requests whose denoise steps run as rows of one batch ------------------
    def batch_key(self, req: T2IRequest):
        """Requests whose denoise phases will share one shape (`pipeline.denoise_key`), as far
        as a request says before its AR phase: its bucket as the spec declares it
        (`spec.BUCKETS`: its size and the bucket of its denoise text if the AR phase writes
        all max_new_tokens, then its steps, schedule, CFG mode and step cache), and for an
        edit its reference's shape and the system prompt's length too.
        After the AR phase the pipeline groups the batch again by the exact shape, so a
        request whose AR ends early or whose `auto` size differs still comes out right: it
        only runs its denoise apart. Its LoRA adapters too: this pipeline runs one adapter set
        a batch, in both phases (`HunyuanT2IPipeline._set_loras`)."""
        pipe = self.pipe
        text = 1 + len(pipe.tok.encode(req.prompt) if req.prompt_ids is None else req.prompt_ids) + req.max_new_tokens
        # (size, rows, steps, shift, CFG, cache), then the adapters
        common = BUCKETS.key(req, pad_rows(text, pipe.prompt_bucket)) + (tuple(req.loras),)
        if req.reference is None:
            return ("t2i",) + common
        return ("edit", tuple(req.reference.shape), len(pipe.tok.encode(req.system_prompt))) + common

    def generate_batch(self, reqs: list[T2IRequest], progress) -> list:
        """The requests on this rank, their denoise steps shared (`pipe.generate_batch`): per
        request its answer (rank 0; None elsewhere) or the exception it left with."""
        graphs = unique_graphs()
        for k, req in enumerate(reqs):
            progress.show(*self._first_phase(req), [k])

        def hook(phase: str, done: int, total: int, members: list[int]) -> dict:
            if phase == "vae":       # only the ranks that decode report it: no agreement there
                progress.show(phase, done, total, members)
                return {}
            left = progress(phase, done, total, members)
            if phase == "denoise" and done == total:
                progress.show("vae", 0, 1, [m for m in members if m not in left])
            return left

        results = self.pipe.generate_batch(reqs, hook)
        new = unique_graphs() - graphs
        return [r if isinstance(r, BaseException) else self._answer(req, r, new) for req, r in zip(reqs, results)]

    @staticmethod
    def _first_phase(req: T2IRequest) -> tuple[str, int, int]:
        return ("condition", 0, 1) if req.reference is not None else ("ar", 0, req.max_new_tokens)

    def _answer(self, req: T2IRequest, result, new_graphs: int) -> dict | None:
        if self.rank != 0:
            return None
        h, w = result.image_size
        # the HTTP side encodes it as the request asked (dtgen.serve.adapters.encode_answer)
        return {"pixels": to_uint8(result.image), "size": f"{w}x{h}", "seed": req.seed,
                "ar_tokens": len(result.tokens),
                # graphs this request (its batch) compiled: 0 for every request of a warmed-up bucket
                "new_graphs": new_graphs,
                # requests whose rows shared this one's denoise steps (itself included)
                "denoise_batch": (result.record.get("denoise_batch") or [1])[0],
                "timings_ms": {k: round(v, 3) for k, v in result.timings_ms.items()},
                # which denoise steps ran in full and which a step cache reused (None: no cache)
                "step_cache": (result.record.get("step_cache") or [None])[0]}

    def warm_up(self, progress) -> None:
        if self.warmup_shapes:
            self.pipe.warm_up(self.warmup_shapes, self.defaults, progress=progress)
        elif self.warmup:
            self.pipe.generate(replace(warmup_request(self.defaults, cached_step=True),
                                       forced_tokens=filler_ids(self.defaults.max_new_tokens)), progress=progress)
        if (self.warmup_shapes or self.warmup) and self.warmup_batch > 1 and self.pipe.compiler.options.enabled:
            # Each batch size has graphs of its own (the batch dimension is static): compile
            # every size a batch can have (one that members left shrinks) before /ready.
            template = replace(warmup_request(self.defaults, cached_step=True),
                               forced_tokens=filler_ids(self.defaults.max_new_tokens))
            # Prompts of n lengths (one row fewer each): rows with their own positions and
            # holes, as traffic has them.
            shapes = [(tokens - 1, size) for tokens, size in self.warmup_shapes] if self.warmup_shapes else \
                [(len(self.pipe.tok.encode(template.prompt)), template.image_size)]
            for length, size in shapes:
                for n in range(2, self.warmup_batch + 1):
                    reqs = [replace(template, seed=template.seed + k, image_size=size,
                                    prompt_ids=filler_ids(max(1, length - k))) for k in range(n)]
                    self.pipe.generate_batch(reqs, per_member([progress] * n))

    def free_caches(self) -> None:
        self.pipe.release_caches()

    def on_step(self, phase: str, done: int, total: int) -> None:
        """Nothing of its own to do at a step boundary."""
