"""The HTTP server on loopback: its overhead over the CLI a request, and its behaviour under load.

- overhead: `examples.hunyuan_t2i` runs N prompts in process (its report's per-request totals), then a
  server with the same flags gets the same N requests one after another. The figure is the median of
  per-request differences (server end to end minus the CLI's total for that request; target <= 2%), and
  the same against the CLI's total plus its PNG write (both sides with the image in hand).
- load: `--requests` requests at each `--concurrency` (1, 4, 16): random sizes of the model's table (some
  over its budget: 422 up front), 10% cancelled after a random wait, 5% malformed, 5% clients that leave
  mid-request. Every request must get a definite answer, no job may be lost or end twice (the server's
  counters), and the idle server's RSS must stay flat; p50/p99 latency and images per minute per level.
Bounded: every request has a timeout and the load part `--budget` seconds.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.harness import Bench

ROOT = Path(__file__).resolve().parents[1]
TARGET_OVERHEAD = 0.02
RSS_GROWTH_LIMIT = 0.10   # "flat": the idle server after the last level within 10% of after the first
IDLE_SETTLE_S = 1.0       # after a level, before the idle sample: the engine trims its heap when idle


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base: str, method: str, path: str, body: bytes | None = None, timeout: float = 300.0):
    request = urllib.request.Request(base + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


def _tree_rss_bytes(pid: int) -> int:
    """RSS of a process and all its descendants (the server and its rank processes)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, AttributeError):
            continue
    return total


class Server:
    def __init__(self, launch: list[str], flags: list[str], log: Path, timeout_s: float):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        with log.open("w") as out:
            self.proc = subprocess.Popen([*launch, "-m", "examples.serve", *flags, "--host", "127.0.0.1",
                                          "--port", str(self.port)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        end = time.monotonic() + timeout_s
        while True:
            try:
                if call(self.base, "GET", "/ready", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                sys.exit(f"the server exited before it was ready (its output: {log})")
            if time.monotonic() > end:
                self.stop()
                sys.exit(f"the server was not ready within {timeout_s:.0f} s (its output: {log})")
            time.sleep(0.5)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)


def metrics(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(dtgen_\S+) (\S+)$", text, re.M)}


# ---- the load test -----------------------------------------------------------------------------
def one_request(base: str, port: int, i: int, rng: random.Random, sizes: list[str], fields: dict,
                timeout: float = 300.0) -> dict:
    """One client: its kind, its definite answer, and for a job the id and final state. A client that
    waited `timeout` seconds gives up: status "client timeout" (it counts against every_request_answered;
    the server must still end the job it accepted: accepted = finished)."""
    t0 = time.perf_counter()
    kind = ["image"]
    try:
        return _one_request(base, port, i, rng, sizes, fields, timeout, kind)
    except (TimeoutError, socket.timeout):
        return {"kind": kind[0], "status": "client timeout", "ms": (time.perf_counter() - t0) * 1e3}
    except (urllib.error.URLError, ConnectionError) as e:
        return {"kind": kind[0], "status": f"connection error: {e}", "ms": (time.perf_counter() - t0) * 1e3}


def _one_request(base: str, port: int, i: int, rng: random.Random, sizes: list[str], fields: dict,
                 timeout: float, kind: list[str]) -> dict:
    roll = rng.random()
    kind[0] = "malformed" if roll < 0.05 else "disconnect" if roll < 0.10 else "cancel" if roll < 0.20 else "image"
    body = dict(fields, prompt=f"a red fox in fresh snow, take {i}", seed=i, size=rng.choice(sizes))
    t0 = time.perf_counter()
    if roll < 0.05:     # malformed: not JSON, or a field of the wrong type
        data = b"{not json" if rng.random() < 0.5 else json.dumps(dict(body, num_inference_steps="two")).encode()
        status, answer = call(base, "POST", "/v1/images/generations", data, timeout)
        return {"kind": "malformed", "status": status, "ms": (time.perf_counter() - t0) * 1e3}
    if roll < 0.10:     # a client that leaves mid-request: the server cancels its job
        data = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            time.sleep(rng.uniform(0.05, 1.0))
        return {"kind": "disconnect", "status": "client left", "ms": (time.perf_counter() - t0) * 1e3}
    if roll < 0.20:     # a job cancelled after a random wait (queued or running)
        status, job = call(base, "POST", "/v1/jobs", json.dumps(body).encode())
        if status != 202:
            return {"kind": "cancel", "status": status, "ms": (time.perf_counter() - t0) * 1e3}
        time.sleep(rng.uniform(0.0, 2.0))
        _, deleted = call(base, "DELETE", f"/v1/jobs/{job['id']}")
        while True:
            _, seen = call(base, "GET", f"/v1/jobs/{job['id']}")
            if seen["status"] not in ("queued", "running"):
                break
            time.sleep(0.05)
        return {"kind": "cancel", "status": seen["status"], "id": job["id"], "delete_answered": deleted["status"],
                "ms": (time.perf_counter() - t0) * 1e3}
    status, answer = call(base, "POST", "/v1/images/generations", json.dumps(body).encode(), timeout)
    out = {"kind": "image", "status": status, "size": body["size"], "ms": (time.perf_counter() - t0) * 1e3}
    if status != 200:
        out["error"] = (answer.get("error") or {}).get("message") if isinstance(answer, dict) else str(answer)[:200]
    return out


def load_level(server: Server, concurrency: int, requests: int, rng: random.Random, sizes: list[str],
               fields: dict, budget_end: float, client_timeout: float = 300.0) -> dict:
    before = metrics(server.base)
    rss = []
    sampling = threading.Event()

    def sample():
        while not sampling.wait(0.25):
            rss.append(_tree_rss_bytes(server.proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    seeds = [(i, random.Random(rng.random())) for i in range(requests)]
    pool = concurrent.futures.ThreadPoolExecutor(concurrency)
    futures = [pool.submit(one_request, server.base, server.port, i, r, sizes, fields, client_timeout)
               for i, r in seeds]
    results, over_budget = [], 0
    for f in futures:
        left = budget_end - time.monotonic()
        try:
            results.append(f.result(timeout=max(left, 1.0)))
        except concurrent.futures.TimeoutError:   # the whole run's --budget is spent: no answer counted
            f.cancel()
            over_budget += 1
    pool.shutdown(wait=over_budget == 0, cancel_futures=True)
    wall = time.perf_counter() - t0
    # the last jobs (a disconnected client's) may still be ending: wait until every accepted one has
    end = time.monotonic() + 120
    while True:
        after = metrics(server.base)
        accepted = after.get('dtgen_requests_total{outcome="accepted"}', 0) - before.get(
            'dtgen_requests_total{outcome="accepted"}', 0)
        finished = sum(after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("dtgen_jobs_total{"))
        if finished >= accepted or time.monotonic() > end:
            break
        time.sleep(0.2)
    sampling.set()
    sampler.join()
    # The level's last answer is out: the server goes idle, trims its heap (dtgen.host.trim_heap)
    # within one queue poll (0.2 s); what it holds then is what it keeps between levels.
    time.sleep(IDLE_SETTLE_S)
    idle_rss = _tree_rss_bytes(server.proc.pid)
    images = [r for r in results if r["kind"] == "image" and r["status"] == 200]
    lat = sorted(r["ms"] for r in images)
    ids = [r["id"] for r in results if "id" in r]
    outcomes: dict[str, int] = {}
    for r in results:
        key = f"{r['kind']}:{r['status']}"
        outcomes[key] = outcomes.get(key, 0) + 1
    definite = all(r["status"] not in (None, "queued", "running", "client timeout") and
                   not str(r["status"]).startswith("connection error") for r in results)
    return {"concurrency": concurrency, "requests": requests, "wall_s": round(wall, 2),
            "outcomes": dict(sorted(outcomes.items())),
            "images": len(images), "images_per_min": round(len(images) / wall * 60, 2),
            "latency_ms": {"p50": round(statistics.median(lat), 1) if lat else None,
                           "p99": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1) if lat else None},
            "every_request_answered": definite and len(results) == requests,
            "client_timeouts": sum(1 for r in results if r["status"] == "client timeout"),
            "not_run_budget_spent": over_budget, "client_timeout_s": client_timeout,
            "server_accepted": int(accepted), "server_finished": int(finished),
            "no_job_lost_or_twice": finished == accepted and len(set(ids)) == len(ids),
            "cancelled_jobs_final": {s: sum(1 for r in results if r["kind"] == "cancel" and r["status"] == s)
                                     for s in ("cancelled", "succeeded", "failed")},
            "rss_bytes": {"start": rss[0] if rss else None, "end": rss[-1] if rss else None,
                          "idle": idle_rss, "max": max(rss) if rss else None, "samples": len(rss)}}


# ---- the overhead --------------------------------------------------------------------------------
def overhead(launch: list[str], common: list[str], requests: int, tmp: Path, timeout_s: float, logs: Path) -> dict:
    """`logs`: where the CLI's and the server's output go (kept: a failed GPU run is read there)."""
    prompts = [f"a red fox in fresh snow, take {i}" for i in range(requests)]
    report = tmp / "t2i.json"
    cli = [*launch, "-m", "examples.hunyuan_t2i", *common, "--warmup", "--report", str(report),
           "--output", str(tmp / "img.png")]
    for prompt in prompts:
        cli += ["--prompt", prompt]
    cli_log = logs.with_name(logs.name + ".cli.log")
    with cli_log.open("w") as out:
        done = subprocess.run(cli, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if done.returncode:
        sys.exit(f"the CLI run for the overhead failed with exit code {done.returncode} (its output: {cli_log})")
    cli_requests = json.loads(report.read_text())["requests"]
    in_process = [r["timings_ms"]["total"] for r in cli_requests]
    # the CLI's PNG of each request, written after its total by the writer the server answers with
    cli_write = [r.get("image_write_ms") for r in cli_requests]
    server = Server(launch, common, logs.with_name(logs.name + ".server.log"), timeout_s)
    size = common[common.index("--image-size") + 1]
    try:
        inside, end_to_end, encode = [], [], []
        for prompt in prompts:
            t0 = time.perf_counter()
            status, answer = call(server.base, "POST", "/v1/images/generations",
                                  json.dumps({"prompt": prompt, "size": size, "seed": 0}).encode())
            end_to_end.append((time.perf_counter() - t0) * 1e3)
            if status != 200:
                sys.exit(f"overhead request failed: {status} {answer}")
            inside.append(answer["dtgen"]["timings_ms"]["total"])
            encode.append(answer["dtgen"].get("image_encode_ms"))
    finally:
        server.stop()
    diffs = [s - c for s, c in zip(end_to_end, in_process)]
    fractions = [d / c for d, c in zip(diffs, in_process)]
    with_image = None
    if None not in cli_write:
        # the same comparison with each side's image in hand: the CLI's total plus its PNG write
        # against the server's answer, which holds the same PNG in base64
        cli_image = [c + w for c, w in zip(in_process, cli_write)]
        image_diffs = [s - c for s, c in zip(end_to_end, cli_image)]
        with_image = {"median_difference_ms": statistics.median(image_diffs),
                      "overhead": statistics.median([d / c for d, c in zip(image_diffs, cli_image)]),
                      "difference_ms": image_diffs}
    return {"requests": requests, "per_request": {"in_process_ms": in_process, "server_inside_ms": inside,
                                                   "server_end_to_end_ms": end_to_end, "difference_ms": diffs,
                                                   "server_image_encode_ms": encode, "cli_image_write_ms": cli_write},
            "median_difference_ms": statistics.median(diffs), "overhead": statistics.median(fractions),
            "against_cli_with_its_image": with_image,
            "outside_generate_ms": statistics.median([e - i for e, i in zip(end_to_end, inside)]),
            # where the time outside the pipeline goes: the answer's PNG (the CLI writes one
            # too, after its total), and the rest (HTTP, JSON, queueing, the engine's hand-offs)
            "image_encode_ms": statistics.median(encode) if None not in encode else None,
            "outside_generate_and_encode_ms": statistics.median(
                [e - i - c for e, i, c in zip(end_to_end, inside, encode)]) if None not in encode else None,
            "target_overhead": TARGET_OVERHEAD}


def main(argv=None) -> int:
    b = Bench("bench.bench_serve", __doc__, argv)
    p = b.parser
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--plan", default="single")
    p.add_argument("--steps", type=int, default=2, help="denoise steps of every request")
    p.add_argument("--max-new-tokens", type=int, default=2)
    p.add_argument("--size", default="256x256", help="WIDTHxHEIGHT of the overhead requests")
    p.add_argument("--requests", type=int, default=100, help="load requests per concurrency level (0: no load part)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--overhead-requests", type=int, default=5, help="0: skip the overhead part")
    p.add_argument("--max-queued", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=3600, help="seconds the whole load part may take")
    p.add_argument("--client-timeout", type=float, default=1200,
                   help="seconds a load client waits for its answer (16 clients on a queue of 16 wait for up to "
                        "16 jobs before theirs); one that gives up is counted, not an error of the bench")
    p.add_argument("--torchrun", action="store_true",
                   help="launch through torchrun, one process per rank (GPUs); else one process that spawns CPU ranks")
    p.add_argument("--timeout", type=float, default=900, help="seconds a server may take to become ready")
    p.add_argument("extra", nargs="*", help="more model flags for the CLI and the server (after --)")
    args = b.parse("outputs/bench_serve.json")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              str(args.world_size)] if args.torchrun else [sys.executable]
    common = ["--world-size", str(args.world_size), "--plan", args.plan, "--steps", str(args.steps),
              "--max-new-tokens", str(args.max_new_tokens), "--ignore-eos", *args.extra]
    result = {"world_size": args.world_size, "plan": args.plan, "steps": args.steps,
              "max_new_tokens": args.max_new_tokens, "extra_flags": args.extra}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)   # the server's and the CLI's logs go beside it
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.overhead_requests:
            result["overhead"] = overhead(launch, [*common, "--image-size", args.size], args.overhead_requests,
                                          tmp, args.timeout, out.with_suffix(".overhead"))
            o = result["overhead"]
            print(f"overhead: median of per-request differences {o['median_difference_ms']:.1f} ms = "
                  f"{o['overhead'] * 100:+.2f}% (target <= {TARGET_OVERHEAD * 100:.0f}%)", flush=True)
        if not args.requests:   # the overhead alone (a GPU run: the load test is the tiny model's)
            b.write(result)
            return 0
        server = Server(launch, [*common, "--max-queued", str(args.max_queued)], out.with_suffix(".server.log"),
                        args.timeout)
        try:
            info = json.loads(urllib.request.urlopen(server.base + "/info", timeout=10).read())
            table = info["defaults"]["sizes"]
            rng = random.Random(args.seed)
            # mostly sizes of the table (any may fit or not: those that do not are 422 up front), some auto
            sizes = ["auto", "auto"] + table
            budget_end = time.monotonic() + args.budget
            result["load"] = []
            for c in (int(x) for x in args.concurrency.split(",")):
                level = load_level(server, c, args.requests, rng, sizes, {"num_inference_steps": args.steps,
                                                                          "max_new_tokens": args.max_new_tokens},
                                   budget_end, args.client_timeout)
                result["load"].append(level)
                b.write(dict(result, complete=False), quiet=True)   # a level at a time
                print(f"concurrency {c:>2}: {level['images']} images, {level['images_per_min']:.1f} images/min, "
                      f"p50 {level['latency_ms']['p50']} ms, p99 {level['latency_ms']['p99']} ms; "
                      f"answered {level['every_request_answered']}, nothing lost {level['no_job_lost_or_twice']}; "
                      f"{level['outcomes']}", flush=True)
        finally:
            server.stop()
    levels = result["load"]
    # Flat: what the idle server holds after the last level against after the first (a leak
    # grows it; the peaks, with requests live, are in each level's rss_bytes.max).
    first_end, last_end = levels[0]["rss_bytes"]["idle"], levels[-1]["rss_bytes"]["idle"]
    growth = (last_end - first_end) / first_end if first_end else None
    result["memory"] = {"rss_idle_after_first_level": first_end, "rss_idle_after_last_level": last_end,
                        "growth": growth, "limit": RSS_GROWTH_LIMIT,
                        "flat": growth is not None and growth <= RSS_GROWTH_LIMIT}
    result["all_answered_nothing_lost"] = all(level["every_request_answered"] and level["no_job_lost_or_twice"]
                                              for level in levels)
    result["complete"] = True
    print(f"memory, the idle server: {first_end / 1e6:.0f} MB -> {last_end / 1e6:.0f} MB ({growth * 100:+.1f}%)")
    b.write(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
