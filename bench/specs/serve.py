"""The serve suite's tables: the server's overhead over the CLI, under load, and the PNG writer."""
from __future__ import annotations

import statistics

from bench.report_cells import Calc, Join, Row, Table, Text, Value
from bench.specs.runs import (PNG_H200_HOST, PNG_ON_CPU, SERVE, SERVE_LOAD, SERVE_OVERHEAD_1202, SERVE_OVERHEAD_1203,
                              SERVE_PNG_CPU, SERVE_WAKEUP_CPU)
from bench.specs.common import goal


def median_of_differences(a, b):
    import statistics
    return statistics.median(x - y for x, y in zip(a, b))


def median_of_shares(a, b):
    import statistics
    return statistics.median(x / y - 1 for x, y in zip(a, b))
SERVE_PER_REQUEST = "overhead.per_request"


_WITH_IMAGE = "overhead.against_cli_with_its_image"


def _overhead(prefix: str, pct: str = "{:.3%}", file: str | None = None) -> Join:
    """"<median difference> ms = <median share>; <= 2%: verdict" of one of bench_serve's comparisons."""
    return Join([Value(f"{prefix}.median_difference_ms", "{:.1f} ms", file), Value(f"{prefix}.overhead", pct, file),
                 goal("<= 2%", Value(f"{prefix}.overhead", file=file), 0.02)], [" = ", "; "])


def _each_and_median(path: str, fmt: str = "{:.1f}") -> Join:
    value = Value(path, fmt)
    return Join([value, Calc(lambda v: statistics.median(v), [value], fmt, lists=True)], "; median ", suffix=" ms")


def _png_median(file: str, name: str, who: str) -> Join:
    return Join([Value(f"images.{name}.{who}.{k}", "{:.1f}", file) for k in ("median_ms", "min_ms", "max_ms")],
                [" ms (", "-"], suffix=")")


TABLES = [
    Table("serve-load", ["concurrency", "requests", "each answered", "jobs", "images", "images/min", "p50",
                             "p99", "server RSS: last sample / max / idle after the level"], [
        Row([str(c), Value(f"{L}.requests"), Value(f"{L}.every_request_answered", lambda v: "yes" if v else "**no**"),
             Join([Value(f"{L}.server_accepted"), Value(f"{L}.server_finished")], " accepted, ", suffix=" ended"),
             Value(f"{L}.images"), Value(f"{L}.images_per_min", "{:.1f}"), Value(f"{L}.latency_ms.p50", "{:.0f} ms"),
             Value(f"{L}.latency_ms.p99", "{:.0f} ms"),
             Join([Value(f"{L}.rss_bytes.end", "{:.0f}", scale=1e-6), Value(f"{L}.rss_bytes.max", "{:.0f}", scale=1e-6),
                   Value(f"{L}.rss_bytes.idle", "{:.0f} MB", scale=1e-6)], " / ")], file=SERVE_LOAD)
        for c, L in ((c, f"load[concurrency={c}]") for c in (1, 4, 16))
    ], note="Tiny model, one CPU process, 2 steps and 2 AR tokens a request, random sizes from the model's table "
            "(those its positions cannot hold: 422 up front), 10% cancelled after a random wait, 5% malformed bodies, "
            "5% clients that leave mid-request; a queue of 16. Run on a shared 2-core machine (four helpers' tests "
            "ran beside it at every level), so the throughput and latencies are this machine's, not the server's "
            "alone. Idle: the server's RSS 1 s after the level's last answer, once the engine has trimmed its heap."),
    Table("serve", ["tiny model, one CPU process, 5 requests of 8 steps at 256x256", "ms"], [
        Row(["the pipeline's total inside the server (median)", Value("medians.server_inside_ms", "{:.1f}")], file=SERVE),
        Row(["what the HTTP client waited (median)", Value("medians.server_end_to_end_ms", "{:.1f}")], file=SERVE),
        Row(["outside the pipeline, per request (HTTP, JSON, queue hand-off, PNG and base64): the median of the "
             "per-request differences",
             Join([Calc(median_of_differences, [Value("per_request.server_end_to_end_ms"),
                                                Value("per_request.server_inside_ms")], "**{:.1f}**", lists=True),
                   Calc(median_of_shares, [Value("per_request.server_end_to_end_ms"),
                                           Value("per_request.server_inside_ms")], "{:.1%}", lists=True)],
                  " (", suffix=" of the request, median of the per-request shares)")], file=SERVE),
        Row(["the same prompts through `examples.hunyuan_t2i` in one process (median)",
             Value("medians.in_process_ms", "{:.1f}")], file=SERVE),
    ], note="Recomputed here from the stored per-request values: the stored `outside_generate_ms` (a difference of "
            "medians of different requests) and `overhead` (against the in-process run, slower for a reason not "
            "found) are not used."),
    Table("serve-overhead-1202", ["HunyuanImage-3, 32 layers, FP8 experts, compiled, 1024x1024, 10 steps, 256 AR "
                                 "tokens, one request at a time, one H200", "ms"], [
        Row(["the CLI in one process, each request's total", Join([Value(f"{SERVE_PER_REQUEST}.in_process_ms",
                                                                          lambda v: ", ".join(f"{x:.0f}" for x in v))])],
            file=SERVE_OVERHEAD_1202),
        Row(["the server: the pipeline's total inside it", Join([Value(f"{SERVE_PER_REQUEST}.server_inside_ms",
                                                                        lambda v: ", ".join(f"{x:.0f}" for x in v))])],
            file=SERVE_OVERHEAD_1202),
        Row(["the server: what the HTTP client waited", Join([Value(f"{SERVE_PER_REQUEST}.server_end_to_end_ms",
                                                                     lambda v: ", ".join(f"{x:.0f}" for x in v))])],
            file=SERVE_OVERHEAD_1202),
        Row(["overhead: the median of the per-request differences (client wait - CLI total)",
             Join([Value("overhead.median_difference_ms", "{:.1f} ms"), Value("overhead.overhead", "{:.2%}"),
                   goal("<= 2%", Value("overhead.overhead"), 0.02)], [" = ", "; "])], file=SERVE_OVERHEAD_1202),
        Row(["of it outside the server's pipeline (client wait - the pipeline's total inside the server, median)",
             Value("overhead.outside_generate_ms", "{:.1f} ms")], file=SERVE_OVERHEAD_1202),
    ], note="bench_serve's overhead part: the CLI runs the 3 prompts in one process (after its warm-up), then a "
            "server with the same flags answers the same 3 requests one after another. Random weights, so the "
            "image is noise: its PNG (in the server's answer; the CLI writes one too, after its total) does not "
            "compress. This run predates two changes: the answer woken by the job's end instead of 50 ms polling, "
            "and the answer's own `image_encode_ms` (the PNG's time), which splits the outside time next run."),
    Table("serve-overhead-cpu", ["tiny model, one CPU process, 256x256, 2 steps, one request at a time",
                            "outside the server's pipeline (client wait - its total inside): median of the requests "
                            "(range)",
                            "of it the answer's PNG (median)"], [
        Row([label, Join([Calc(fn, [Value(f"{SERVE_PER_REQUEST}.server_end_to_end_ms"),
                                    Value(f"{SERVE_PER_REQUEST}.server_inside_ms")], "{:.1f}", lists=True)
                          for fn in (median_of_differences, lambda e, i: min(a - b for a, b in zip(e, i)),
                                     lambda e, i: max(a - b for a, b in zip(e, i)))], [" ms (", "-"], suffix=")"),
             Value("overhead.image_encode_ms", "{:.1f} ms") if png else Text("not reported then")], file=f)
        for label, f, png in (("before: the answer polled every 50 ms (2 requests)", SERVE_WAKEUP_CPU[0], False),
                              ("**after: woken by the job's end** (3 requests)", SERVE_WAKEUP_CPU[1], True),
                              ("session 16: dtgen's PNG writer, encoded on the HTTP side after the job (5 requests)",
                               SERVE_PNG_CPU, True))
    ], note="bench_serve's overhead part on this shared 2-core machine. The CLI comparison (the `overhead` figure) "
            "is not shown: on 2 cores the server's pipeline itself runs slower than the CLI's."),
    Table("png-cpu", ["1024x1024 RGB, one PNG, this 2-core machine", "Pillow's writer (default): each call (ms)",
                      "median (range)", "dtgen/image_files.py: each call (ms)", "median (range)", "Pillow / dtgen",
                      "bytes: Pillow / dtgen"], [
        Row([label, Value(f"images.{name}.pillow.ms", "{:.1f}"),
             Join([Value(f"images.{name}.pillow.median_ms", "{:.1f}"), Value(f"images.{name}.pillow.min_ms", "{:.1f}"),
                   Value(f"images.{name}.pillow.max_ms", "{:.1f}")], [" ms (", "-"], suffix=")"),
             Value(f"images.{name}.dtgen.ms", "{:.1f}"),
             Join([Value(f"images.{name}.dtgen.median_ms", "{:.1f}"), Value(f"images.{name}.dtgen.min_ms", "{:.1f}"),
                   Value(f"images.{name}.dtgen.max_ms", "{:.1f}")], [" ms (", "-"], suffix=")"),
             Value(f"images.{name}.pillow_over_dtgen", "{:.2f}x"),
             Join([Value(f"images.{name}.pillow.bytes", "{:,}"), Value(f"images.{name}.dtgen.bytes", "{:,}")], " / ")],
            file=PNG_ON_CPU)
        for name, label in (("noise", "uniform noise (what random weights decode to)"),
                            ("smooth", "a smooth image with a little noise"))
    ], note="5 timed calls per encoder and image after one warm-up, in one process. Both files hold the same "
            "pixels (the JSON's `reads_back_exact`). Not run on the GPU host (16 cores; the writer uses up to 8 "
            "threads): `bash bench/run_gpu.sh serve:png` runs it there."),
    Table("serve-overhead-1203", ["HunyuanImage-3, 32 layers, FP8 experts, compiled, 1024x1024, 10 steps, 256 AR "
                                 "tokens, one request at a time, one H200", "ms"], [
        Row(["the CLI in one process, each request's total (the pipeline)",
             Value(f"{SERVE_PER_REQUEST}.in_process_ms", "{:.0f}")], file=SERVE_OVERHEAD_1203),
        Row(["the server: the pipeline's total inside it", Value(f"{SERVE_PER_REQUEST}.server_inside_ms", "{:.0f}")],
            file=SERVE_OVERHEAD_1203),
        Row(["the server: what the HTTP client waited", Value(f"{SERVE_PER_REQUEST}.server_end_to_end_ms", "{:.0f}")],
            file=SERVE_OVERHEAD_1203),
        Row(["per request: client wait - the CLI's total", Value(f"{SERVE_PER_REQUEST}.difference_ms", "{:.1f}")],
            file=SERVE_OVERHEAD_1203),
        Row(["overhead against the CLI's pipeline total: the median of the per-request differences",
             _overhead("overhead")], file=SERVE_OVERHEAD_1203),
        Row(["per request: client wait - (the CLI's total + its PNG write)",
             Value(f"{_WITH_IMAGE}.difference_ms", "{:.1f}")], file=SERVE_OVERHEAD_1203),
        Row(["**overhead against the CLI with its PNG written** (both sides end holding an encoded PNG): the median",
             _overhead(_WITH_IMAGE)], file=SERVE_OVERHEAD_1203),
        Row(["the PNG, per request: the server's encode (`image_encode_ms`)",
             _each_and_median(f"{SERVE_PER_REQUEST}.server_image_encode_ms")], file=SERVE_OVERHEAD_1203),
        Row(["the PNG, per request: the CLI's write (`image_write_ms`, after its total)",
             _each_and_median(f"{SERVE_PER_REQUEST}.cli_image_write_ms")], file=SERVE_OVERHEAD_1203),
        Row(["outside the server's pipeline (client wait - its total inside), median / less the PNG's encode, median",
             Join([Value("overhead.outside_generate_ms", "{:.1f}"),
                   Value("overhead.outside_generate_and_encode_ms", "{:.1f}")], " / ", suffix=" ms")], file=SERVE_OVERHEAD_1203),
        Row(["session 15 (3 requests; the answer polled every 50 ms, its PNG by Pillow's writer): against the CLI's "
             "pipeline total", _overhead("overhead", "{:.2%}", SERVE_OVERHEAD_1202)]),
    ], note="bench_serve's overhead part: the CLI runs the 5 prompts in one process (after its warm-up), writing each "
            "PNG after its total (`image_write_ms`); then a server with the same flags answers the same 5 requests one "
            "after another, each answer's PNG encoded on the HTTP side after the job (`image_encode_ms`) by the same "
            "writer (dtgen/image_files.py). Random weights, so the image is noise, which does not compress. An "
            "overhead is the median of the per-request differences and, as a share, the median of each difference "
            "over that request's CLI time (with its PNG write in the second comparison); the verdict is on the "
            "share."),
    Table("png-h200-host", ["1024x1024 RGB, one PNG, the GPU host's CPU", "cores / the writer's threads",
                      "Pillow's writer (default): each call (ms)", "median (range)",
                      "dtgen/image_files.py: each call (ms)", "median (range)", "Pillow / dtgen",
                      "dtgen on 2 cores (`png-cpu`)"], [
        Row([label, Join([Value("cpus"), Value("threads")], " / "), Value(f"images.{name}.pillow.ms", "{:.1f}"),
             _png_median(PNG_H200_HOST, name, "pillow"), Value(f"images.{name}.dtgen.ms", "{:.1f}"),
             _png_median(PNG_H200_HOST, name, "dtgen"), Value(f"images.{name}.pillow_over_dtgen", "{:.2f}x"),
             _png_median(PNG_ON_CPU, name, "dtgen")], file=PNG_H200_HOST)
        for name, label in (("noise", "uniform noise (what random weights decode to)"),
                            ("smooth", "a smooth image with a little noise"))
    ], note="bench_image_files on the H200 host, in the same call, before bench_serve: 5 timed calls per encoder and "
            "image after one warm-up, in one process; both files hold the same pixels (the JSON's "
            "`reads_back_exact`). The last column is session 16's run on a 2-core machine (2 threads)."),
]
