"""The command of an encode -> denoise -> decode model (Wan, Qwen-Image), written once: its
flags, its checks before any work, its run on every rank, its report and its server adapter.

A model's command module (models/<m>/cli.py, run by `dtgen run`) declares one `DiffusionCommand`:
data (its request class, plans, configs reader, loader, pipeline, tiny default, the defaults
that depend on the checkpoint); it offers the registry's pieces (dtgen/registry.py) as that
command's bound methods. From it this module parses the command line, checks it (`prepare`),
builds the pipeline on each rank, warms it up, runs the request (with `--check`: against the
same request on one process; with `--profile`: once more under the profiler), gathers every
rank's facts, and on rank 0 writes the output (an image file, or an MP4: dtgen/media.py),
prints the table and writes the JSON report. HunyuanImage-3's command (AR, several prompts, edits) is its own.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from . import schema
from .checkpoint import unreadable
from .compile import CompileOptions, unique_graphs
from .fp8 import add_fp8_flags, attention_head_problem
from .harness import (add_run_flags, compile_facts, compile_problem, example_main, finish_launch_args,
                      gather_rank_facts, launch_problem, max_diff, output_path_problem, peak_memory, rank_device,
                      reference_threads, rel_l2, table)
from .host import GcPauses, settle_heap
from .image_files import image_path_problem, save_image
from .launch import RankContext
from .lora import ResidentLoras
from .lora.flags import add_lora_flags, lora_problem, request_loras, resident_loras
from .media import FPS, encode_mp4, video_path_problem
from .profiling import PhaseProfiler
from .reference_images import ReferenceImage
from .registry import resolve
from .requests import RequestError, flag_line

# The profile table's rows of a `DiffusionRun` pipeline's timings (dtgen.profiling.PhaseProfiler).
PROFILE_ROWS = (("encode", "text encode", "ms"), ("denoise", "denoise (all steps)", "ms"),
                ("decode", "VAE decode", "ms"), ("total", "total", "ms"))
NOT_A_CHECKPOINT = "no model_index.json there (expected a diffusers-format folder)"
# A DiT's head size when its transformer/config.json names none (diffusers' default for both).
DEFAULT_HEAD_DIM = 128


@dataclass(frozen=True)
class DiffusionCommand:
    """What an encode -> denoise -> decode model's command supplies (the rest is this module's).
    Every field pickles by reference or by value (spawned ranks receive the bound `run_rank`):
    module-level functions and classes, no lambdas."""

    name: str                       # the registry's name: `dtgen run --model <name>`
    title: str                      # in help and messages, e.g. "Wan"
    module: str                     # the command module (models.<m>.cli): spawned ranks import it first
    description: str                # the command's --help line
    request: type                   # the request dataclass (dtgen/schema.py): its fields are the request flags
    default_prompt: str
    output: str                     # the CLI's default --output
    fp8_reach: tuple[str, str]      # what --dense-dtype fp8 and --attention-dtype fp8 move to FP8 (their help)
    plans: dict = field(repr=False)   # the placements module's PLANS
    get_plan: Callable              # the placements module's get_plan(name): ValueError naming an unknown one
    multi_rank_plan: str            # the plan without --plan on several ranks
    tiny_defaults: dict             # flag -> value where the flag is not given, on the tiny default
    checkpoint_defaults: dict       # flag -> value where the flag is not given, on a --checkpoint
    ensure_tiny: Callable[[], Path]   # the tiny default's folder, written once
    checkpoint_problem: Callable    # models.registry.checkpoint_problem(name, folder, missing)
    # the checkpoint's configs from its folder (the model's `cfgs`; ValueError for one that cannot
    # be read): a request is checked against them (`pipeline.check_args`) before any rank loads
    configs: Callable[[Path], object]
    # load(checkpoint, plan, rank, world_size, dtype, device, dense_dtype=, attention_dtype=)
    loader: Callable
    # Pipeline(model, tokenizer, controller, device, is_main, compile_options, vae_group): a DiffusionPipeline
    pipeline: Callable
    adapter: str                    # "module:Class" of its `dtgen.serve` adapter (imported by a server only)
    # flag -> fallback: flags whose default is the checkpoint's scheduler_config.json value of that name
    scheduler_defaults: dict = field(default_factory=dict)
    profile_rows: tuple = PROFILE_ROWS   # the profile table's rows (dtgen.profiling.PhaseProfiler)
    # the model's LoRA name map (`ModelAdapter.lora_prefixes`): --lora files are matched against the
    # checkpoint with it before any rank loads
    lora_prefixes: dict = field(default_factory=dict)
    # the tiny default that starts from a reference image (a model whose pipeline takes one,
    # `pipeline.reference`): what --image runs without --checkpoint, and a server's --image-to-<makes>
    ensure_tiny_from_image: Callable[[], Path] | None = None
    # the table's row for what is made, from the flags and rank 0's facts (default: `describe_made`)
    describe: Callable[[argparse.Namespace, dict], str] | None = None

    @property
    def makes(self) -> str:
        """"image" or "video" (the pipeline's): the result's attribute, the output, the table's row."""
        return self.pipeline.makes

    @property
    def flag_of_field(self) -> dict[str, str]:
        """The request fields' flags: `check` names fields, the CLI names flags."""
        return schema.flag_names(self.request)

    # ---- the registry's command pieces (dtgen/registry.py), bound to this model --------------
    def build_parser(self, prog: str | None = None, description: str | None = None,
                     cli: bool = True) -> argparse.ArgumentParser:
        """The model, plan, compile and request flags; `cli=False` (a server, which adds its own):
        without the flags only the CLI reads (the prompt, --check, --profile, --output, --report)."""
        p = argparse.ArgumentParser(prog=prog or f"dtgen run --model {self.name}", allow_abbrev=False,
                                    description=description or self.description)
        p.add_argument("--checkpoint", help=f"diffusers-format {self.title} folder (default: the embedded tiny model)")
        # the request's fields; a server's requests give their prompt and reference image (an upload)
        schema.add_flags(p, self.request, omit=() if cli else ("prompt", "image"),
                         defaults={"prompt": self.default_prompt})
        if self.makes == "video":
            schema.add_flags(p, [FPS])
        if not cli and self.ensure_tiny_from_image is not None:   # a server's requests bring their images
            p.add_argument(f"--image-to-{self.makes}", dest="tiny_from_image", action="store_true",
                           help=f"without --checkpoint: serve the tiny image-to-{self.makes} default (every "
                                f"request brings {self.pipeline.reference.upload})")
        add_fp8_flags(p, *self.fp8_reach)
        add_diffusion_flags(p)
        add_run_flags(p, self.plans, self.output, cli, dict(prompt=self.default_prompt), self.title)
        return p

    def finish_args(self, args: argparse.Namespace) -> argparse.Namespace:
        return finish_launch_args(args, lambda world: "single" if world == 1 else self.multi_rank_plan)

    def parse_args(self, argv=None, prog: str | None = None) -> argparse.Namespace:
        return self.finish_args(self.build_parser(prog).parse_args(argv))

    def request_from_args(self, args: argparse.Namespace):
        """The request the flags say (a server's: the defaults of the fields a request leaves out);
        `RequestError` naming a field for a size or step cache that does not parse."""
        return schema.from_args(self.request, args, loras=request_loras(args))

    def prepare(self, args: argparse.Namespace) -> tuple[str | None, bool]:
        """Check the command line and fill the defaults that depend on the checkpoint: (the first
        problem as one line or None, whether the tiny default runs)."""
        tiny = args.checkpoint is None
        if getattr(args, "tiny_from_image", False) and not tiny:
            return (f"--image-to-{self.makes} picks the tiny default; a --checkpoint's model_index.json says whether "
                    f"it makes {self.makes} from an image"), False
        try:
            self.size_from_reference(args)
        except RequestError as e:
            return flag_line(e, self.flag_of_field), tiny
        for key, value in (self.tiny_defaults if tiny else self.checkpoint_defaults).items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        try:
            problem = launch_problem(args, self.get_plan(args.plan)) or compile_problem(args) \
                or vae_parallel_problem(args) or output_path_problem(args.output, "--output") \
                or (image_path_problem(args.output) if self.makes == "image" else video_path_problem(args.output)) \
                or output_path_problem(args.report, "--report") or lora_problem(args)
            if problem is None and not tiny:
                problem = self.checkpoint_problem(self.name, args.checkpoint, NOT_A_CHECKPOINT) \
                    or unreadable(args.checkpoint)
            if problem is not None:
                return problem, tiny
            if tiny:
                args.checkpoint = str(self.tiny_checkpoint(args))
            folder = Path(args.checkpoint)
            problem = lora_problem(args, folder, self.lora_prefixes) if args.lora else None
            if problem is not None:
                return problem, tiny
            scheduler_file = folder / "scheduler" / "scheduler_config.json"
            scheduler = json.loads(scheduler_file.read_text()) if scheduler_file.is_file() else {}
            for key, fallback in self.scheduler_defaults.items():
                if getattr(args, key) is None:
                    setattr(args, key, scheduler.get(key, fallback))
            req = self.request_from_args(args)
            self.check_request(args, req, folder)
            args.step_cache = req.step_cache    # parsed once, for the ranks and the report
            if self.makes == "video":
                schema.check_value(FPS, args.fps, "--fps")
            transformer = json.loads((folder / "transformer" / "config.json").read_text())
            head_dim = transformer.get("attention_head_dim", DEFAULT_HEAD_DIM)
            problem = attention_head_problem(args.attention_dtype, head_dim)
            # the prompts against what the text encoder reads (a server, with no prompt flag, checks
            # each request's as it comes)
            if problem is None and getattr(args, "prompt", None) is not None:
                self.pipeline.check_prompts(self.pipeline.folder_tokenizer(folder), req)
            return problem, tiny
        except RequestError as e:
            return flag_line(e, self.flag_of_field), tiny
        except OSError as e:   # its text names the file
            return str(e), tiny
        except (KeyError, ValueError) as e:
            return (str(e.args[0]) if e.args else str(e)), tiny

    def check_request(self, args: argparse.Namespace, req, folder: Path) -> None:
        """The request the flags make, checked against the checkpoint's configs before any rank
        loads (a server's: the defaults its requests start from; where its checkpoint starts
        from a reference image, each request brings its own, so they are checked as one that did)."""
        cfgs, reference = self.configs(folder), self.pipeline.reference
        if reference is not None and not hasattr(args, reference.field) and self.pipeline.takes_reference(cfgs):
            grey = torch.full((reference.min_side, reference.min_side, 3), 128, dtype=torch.uint8)
            req = replace(req, **{reference.field: ReferenceImage(grey, "a request's own")})
        req.check(*self.pipeline.check_args(cfgs))

    def tiny_checkpoint(self, args: argparse.Namespace) -> Path:
        """The tiny default's folder for this command line: the one that starts from an image
        where the command line brings one (--image) or a server is told its requests will."""
        reference = self.pipeline.reference
        from_image = reference is not None and getattr(args, reference.field, None) is not None
        if self.ensure_tiny_from_image is not None and (from_image or getattr(args, "tiny_from_image", False)):
            return self.ensure_tiny_from_image()
        return self.ensure_tiny()

    def size_from_reference(self, args: argparse.Namespace) -> None:
        """With a reference image (--image) and neither --height nor --width: the output's size
        from the image's aspect ratio, at about the default size's area (`RequestError` naming
        the image's field for a file that does not open)."""
        reference = self.pipeline.reference
        path = None if reference is None else getattr(args, reference.field, None)
        if path is None or args.height is not None or args.width is not None:
            return
        defaults = self.tiny_defaults if args.checkpoint is None else self.checkpoint_defaults
        area = defaults["height"] * defaults["width"]
        args.height, args.width = reference.output_size(reference.open_file(path), area)

    def main(self, argv=None, prog: str | None = None) -> int:
        return example_main(self.parse_args(argv, prog), self.prepare, self.run_rank, self.write_report,
                            (self.module,))

    def build_pipeline(self, ctx: RankContext, args: argparse.Namespace):
        return build_pipeline(self, ctx, args)

    def run_rank(self, ctx: RankContext, args: argparse.Namespace) -> dict:
        return run_rank(self, ctx, args)

    def write_report(self, args: argparse.Namespace, main: dict, tiny: bool) -> dict:
        return write_report(self, args, main, tiny)

    def serve_adapter(self, ctx: RankContext, args: argparse.Namespace, max_batch: int):
        """This rank's pipeline behind the server (requests of one bucket batch: --max-batch); the
        flags' request holds the defaults."""
        pipe, loaded, _, dtype = self.build_pipeline(ctx, args)
        if pipe.loras is None and loaded.lora_prefixes:   # adapters loaded by name while serving (POST /v1/loras)
            pipe.loras = ResidentLoras(loaded, dtype)
        output = {"fps": args.fps} if self.makes == "video" else {}
        return resolve(self.adapter)(pipe, ctx.rank, self.request_from_args(args), warmup=args.warmup is not False,
                                     warmup_batch=max_batch, **output)

    def save(self, output: torch.Tensor, path: Path, args: argparse.Namespace) -> None:
        """Rank 0's output -> the file: an image ([H, W, 3] uint8) in the format its suffix
        names, a video ([F, H, W, 3] uint8) as an H.264 MP4 at --fps."""
        if self.makes == "video":
            encode_mp4(output, str(path), args.fps)
        else:
            save_image(path, output)


def add_diffusion_flags(p: argparse.ArgumentParser) -> None:
    """The flags every such command takes alike (the CLI's and the server's)."""
    p.add_argument("--vae-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="with several ranks, split the VAE decode over all of them (default: on)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run the request once with 2 steps first, so that compilation and first-call kernel JIT "
                        "stay out of the figures (default: on with --compile or on GPU; a server: on, before /ready)")
    add_lora_flags(p)


def vae_parallel_problem(args: argparse.Namespace) -> str | None:
    """--vae-parallel given on one rank: one line (it would be ignored)."""
    if args.vae_parallel is not None and args.world_size == 1:
        flag = "--vae-parallel" if args.vae_parallel else "--no-vae-parallel"
        return f"{flag} splits the VAE decode over several ranks; this run has --world-size 1"
    return None


def _load(command: DiffusionCommand, args, plan: str, rank: int, world_size: int, dtype, device):
    return command.loader(args.checkpoint, command.get_plan(plan), rank, world_size, dtype, device,
                          dense_dtype=args.dense_dtype, attention_dtype=args.attention_dtype)


def build_pipeline(command: DiffusionCommand, ctx: RankContext, args: argparse.Namespace):
    """This rank's share of the model, loaded, and its pipeline (the command's and the server's):
    (pipeline, loaded, device, dtype)."""
    device, dtype = rank_device(ctx, args)
    ctx.progress("loading")
    loaded = _load(command, args, args.plan, ctx.rank, ctx.world_size, dtype, device)
    options = CompileOptions(enabled=args.compile, backend=args.compile_backend, regions=args.compile_mode == "regions")
    vae_group = dist.group.WORLD if args.vae_parallel is not False and ctx.world_size > 1 else None
    pipe = command.pipeline(loaded.model, loaded.tokenizer, loaded.controller, device, ctx.rank == 0, options,
                            vae_group)
    pipe.loras = resident_loras(loaded, args, dtype)
    return pipe, loaded, device, dtype


def cache_decisions(report: dict) -> list:
    """What a step cache decided: the full steps, and per row where rows decide (first-block)."""
    return [report["full_steps"], report.get("full_rows"),
            [s.get("full_rows") for s in report.get("segments", [])]]


def _check(command: DiffusionCommand, ctx, args, req, result, dtype, device) -> dict:
    """Rank 0: this run against the same request on one process (`--check`)."""
    with reference_threads(ctx, device):
        reference = _load(command, args, "single", 0, 1, dtype, device)
        ref_pipe = command.pipeline(reference.model, reference.tokenizer, reference.controller, device)
        ref_pipe.loras = resident_loras(reference, args, dtype)   # the same adapters, on one process
        ref = ref_pipe.generate(req, record=True)
    mine, theirs = getattr(result, command.makes), getattr(ref, command.makes)
    check = {"max_abs_diff_noise": max_diff(result.record["noise"], ref.record["noise"]),
             "max_abs_diff_latents": max_diff([result.latents], [ref.latents]),
             f"max_abs_diff_{command.makes}": max_diff([mine], [theirs]),
             "rel_l2_noise": rel_l2(result.record["noise"], ref.record["noise"])}
    if req.step_cache is not None:   # the plan must take every decision one process takes
        check["same_cache_decisions"] = cache_decisions(result.record["step_cache"]) == \
            cache_decisions(ref.record["step_cache"])
    return check


def run_rank(command: DiffusionCommand, ctx: RankContext, args: argparse.Namespace) -> dict:
    """One request on this rank (warm-up, the timed run, --profile, --check); rank 0's dict
    holds the output and everything the report needs."""
    pipe, loaded, device, dtype = build_pipeline(command, ctx, args)
    req = command.request_from_args(args)

    def progress(phase, done, total):
        ctx.progress(f"{phase} {done}/{total}")

    warmup_ms = None
    if args.warmup if args.warmup is not None else (args.compile or device.type == "cuda"):
        t0 = time.perf_counter()
        pipe.generate(replace(req, steps=min(req.steps, 2)), progress=progress)
        warmup_ms = (time.perf_counter() - t0) * 1e3
    warm_graphs = unique_graphs()
    settle_heap()   # keep the collector off what loading and compiling made (dtgen/host.py)
    with GcPauses() as gc_pauses:
        result = pipe.generate(req, progress=progress, record=args.check)
    compile_report = compile_facts(pipe.compiler, warm_graphs) if args.compile else None
    profile_summary = None
    if args.profile:
        profiler = PhaseProfiler(args.profile, ctx.rank, group=loaded.controller.topology.control,
                                 table_rows=command.profile_rows)
        profiled = pipe.generate(req, progress=progress, profiler=profiler)
        profile_summary = profiler.write(profiled.timings_ms, compile_report)
    out = {"rank": ctx.rank, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
           "request": _request_fields(req), "timings_ms": result.timings_ms, "warmup_ms": warmup_ms,
           "compile": compile_report, "tokens_per_step": result.record.get("tokens_per_step"),
           "profile": profile_summary, "step_cache": result.record.get("step_cache")}
    facts = {"rank": ctx.rank, "switch": loaded.controller.last_switch.as_dict(),
             "storage_bytes": loaded.storage.nbytes, "peak_memory_bytes": peak_memory(device),
             "gc": gc_pauses.as_dict()}
    out["ranks"] = gather_rank_facts(ctx, facts, loaded.controller.topology.control)
    if ctx.rank == 0:
        out["output"] = getattr(result, command.makes)
        if args.check:
            out["check"] = _check(command, ctx, args, req, result, dtype, device)
    return out


def _request_fields(req) -> dict:
    """The request as the report records it: every field but the prompts, JSON-ready."""
    fields = {k: v for k, v in dataclasses.asdict(req).items() if k not in ("prompt", "negative_prompt")}
    return json.loads(json.dumps(fields, default=str))   # (a step cache's config is a dataclass: a dict by now)


def steps_text(steps: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def _cache_rows(report: dict) -> list[tuple[str, str]]:
    cache = report.get("step_cache")
    if cache is None:
        return []
    r = report["timings_ms"]
    knobs = ", ".join(f"{k}={v}" for k, v in cache["config"].items() if k not in ("method", "mag_ratios"))
    ms = lambda v: "-" if v is None else f"{v:.1f} ms"  # noqa: E731
    rows = [("step cache", f"{cache['method']} ({knobs})"),
            ("full steps", f"{len(cache['full_steps'])} of {cache['steps']}: {steps_text(cache['full_steps'])}"),
            ("reused steps", steps_text(cache["cached_steps"])),
            ("full / reused step", f"{ms(r['denoise_full_step'])} / {ms(r['denoise_cached_step'])}")]
    rows_full = cache.get("full_rows")
    if rows_full and any(len(set(row)) > 1 for row in rows_full):
        rows.append(("rows differ", ", ".join(f"step {i}: " + "".join("F" if f else "c" for f in row)
                                              for i, row in enumerate(rows_full) if len(set(row)) > 1)))
    if "mag_ratios" in cache:
        rows.append(("mag_ratios", "/".join(f"{x:.5f}" for x in cache["mag_ratios"])))
    return rows


def _report(args, main: dict, tiny: bool) -> dict:
    t, ranks = main["timings_ms"], main["ranks"]
    steps = t["denoise_step"]
    report = {"plan": args.plan, "world_size": args.world_size, "device": main["device"], "dtype": main["dtype"],
              "torch": torch.__version__, "checkpoint": "tiny-default" if tiny else args.checkpoint,
              "dense_dtype": args.dense_dtype, "attention_dtype": args.attention_dtype,
              "request": main["request"], "tokens_per_step": main["tokens_per_step"],
              "timings_ms": {"encode": t["encode"], "denoise_step": sum(steps[1:]) / max(len(steps) - 1, 1),
                             "denoise_first_step": steps[0], "decode": t["decode"], "total": t["total"],
                             "denoise_steps": steps},
              "warmup_ms": main["warmup_ms"], "phase_switch": max((r["switch"] for r in ranks), key=lambda s: s["ms"]),
              "storage_bytes_per_rank": [r["storage_bytes"] for r in ranks],
              "peak_memory_bytes_per_rank": [r["peak_memory_bytes"] for r in ranks]}
    if main.get("step_cache") is not None:
        report["step_cache"] = main["step_cache"]
        report["timings_ms"]["denoise_full_step"] = t["denoise_full_step"]      # steps after the first
        report["timings_ms"]["denoise_cached_step"] = t["denoise_cached_step"]
    for key in ("check", "compile"):
        if main.get(key) is not None:
            report[key] = main[key]
    return report


def _rows(command: DiffusionCommand, args, main: dict, report: dict) -> list[tuple[str, str]]:
    r, switch, ranks = report["timings_ms"], report["phase_switch"], main["ranks"]
    warm = "off" if main["warmup_ms"] is None else f"{main['warmup_ms']:9.1f} ms (not in the figures)"
    rows = [("plan", f"{args.plan} on {args.world_size} rank(s), {main['device']}, {main['dtype']}"),
            (command.makes, (command.describe or describe_made)(args, main)), ("warm-up run", warm),
            ("text encode", f"{r['encode']:9.1f} ms"),
            ("denoise", f"{r['denoise_step']:9.1f} ms/step ({len(r['denoise_steps'])} steps; the first "
                        f"{r['denoise_first_step']:.1f} ms)"),
            ("phase switch", f"{switch['ms']:9.2f} ms, weights copied {switch['weights_copied']}"),
            *_cache_rows(report),
            ("VAE decode", f"{r['decode']:9.1f} ms"),
            ("total", f"{r['total']:9.1f} ms")]
    if all(p is not None for p in report["peak_memory_bytes_per_rank"]):
        rows.append(("memory / rank", ", ".join(f"{x['storage_bytes'] / 1e9:.1f} GB weights, "
                                                f"{x['peak_memory_bytes'] / 1e9:.1f} GB peak" for x in ranks)))
    if "compile" in report:
        c = report["compile"]
        rows.append(("compile", f"{c['graphs']} graphs, {c['graph_breaks']} breaks, "
                                f"{c['recompiles_after_warmup']} recompiles after warm-up, {c['compile_s']:.1f} s"))
    rows += [(f"check {k}", str(v) if isinstance(v, bool) else f"{v:.3e}") for k, v in report.get("check", {}).items()]
    return rows


def describe_made(args, main: dict) -> str:
    """The table's row for what is made: its size (a video's frames too), and where a model
    counts them, the DiT's tokens per step; the reference image it started from, if any."""
    r = main["request"]
    made = f"{r['width']}x{r['height']}"
    if "num_frames" in r:   # a video: its frames, then its size as height x width
        made = f"{r['num_frames']} frames, {r['height']}x{r['width']}"
    if main.get("tokens_per_step") is not None:
        made += f", {main['tokens_per_step']} tokens/step"
    image = getattr(args, "image", None)
    return made if image is None else f"{made}, from {image}"


def write_report(command: DiffusionCommand, args, main: dict, tiny: bool) -> dict:
    """Rank 0: the output file, the table on stdout, and the JSON report (--report)."""
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    command.save(main["output"], out, args)
    report = _report(args, main, tiny)
    print(table(_rows(command, args, main, report)))
    print(f"wrote {out}")
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.report}")
    return report
