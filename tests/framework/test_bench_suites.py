"""`python -m bench` (bench/suites.py): the listing, each suite's scripts, and a refused name (CPU)."""
import importlib

import pytest

from bench import suites
from bench.suites import SUITES, main

MODULES = sorted({p.module for s in SUITES for p in s.parts})


def test_the_listing_names_every_suite_once_with_what_it_measures(capsys):
    assert main([]) == 0
    listed = capsys.readouterr().out
    assert main(["--list"]) == 0 and capsys.readouterr().out == listed
    for s in SUITES:
        lines = [line for line in listed.splitlines() if line.split()[:1] == [s.name]]
        assert lines == [f"  {s.name:{max(len(x.name) for x in SUITES)}}  {s.what}"], s.name
    assert {s.name for s in SUITES} >= {"decode", "dit", "e2e", "memory", "vae", "kernels", "serve", "compile",
                                        "step-cache", "peers"}


@pytest.mark.parametrize("module", MODULES)
def test_each_suite_script_imports_on_the_cpu(module):
    importlib.import_module(module)


def test_an_unknown_suite_is_one_line_naming_the_known_ones(capsys):
    assert main(["decod"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'decod'" in err and all(s.name in err for s in SUITES)


def test_a_part_runs_its_module_with_its_fixed_flags_first(monkeypatch):
    ran = []
    monkeypatch.setattr(suites, "run_module", lambda module, argv: ran.append((module, argv)) or 7)
    assert main(["kernels", "split-kv", "--repeats", "1"]) == 7
    assert main(["decode", "--layers", "2"]) == 7   # no part named: the suite's default
    assert main(["e2e"]) == 7
    assert ran == [("bench.bench_decode_batch", ["--parts", "kernel", "--repeats", "1"]),
                   ("bench.bench_decode", ["--layers", "2"]),
                   ("dtgen", ["run", "--model", "hunyuan-image3"])]


def test_a_word_that_names_no_part_is_refused_not_handed_to_the_default(monkeypatch, capsys):
    monkeypatch.setattr(suites, "run_module", lambda module, argv: pytest.fail("ran " + module))
    assert main(["decode", "stepp"]) == 2
    assert main(["kernels"]) == 2   # no default part
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "'stepp'" in err[0] and "its parts: step " in err[0] and "moe, grouped-gemm" in err[1]


def test_a_suite_help_gives_each_part_and_its_flags(capsys):
    assert main(["vae", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"python -m bench vae: {suites.suite('vae').what}")
    for part in suites.suite("vae").parts:
        assert f"(python -m {' '.join((part.module, *part.args))})" in out
    assert "--only-bf16" in out and "--sizes" in out   # the suite's flag, the FLOP count's


def test_a_part_runs_as_its_script_does_and_its_exit_status_comes_back(tmp_path, capsys):
    out = tmp_path / "flops.json"
    assert main(["vae", "flops", "--sizes", "64", "--out", str(out)]) == 0
    assert out.is_file() and '"command": "python -m bench.bench_vae --flops --sizes 64' in out.read_text()
    assert main(["vae", "flops", "--sizes"]) == 2   # argparse's refusal


def test_the_runner_lists_the_steps_it_would_run_in_order(tmp_path, capsys):
    assert main(["run-all", "decode,kernels:moe", "--out", str(tmp_path), "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["decode_dense_fp8", "moe"]
    assert "-m bench.bench_decode --layers 32" in lines[0] and f"--out {tmp_path}/decode_dense_fp8.json" in lines[0]
    assert "-m bench.bench_moe --out" in lines[1]


def test_the_runner_refuses_a_step_a_suite_does_not_have(capsys):
    assert main(["run-all", "kernels:nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nope'" in err and "moe, grouped-gemm" not in err and "moe, grouped_gemm" in err
    assert main(["run-all", "decode", "--with", "moe=--iters 1"]) == 2   # a flag for a step not selected


def test_every_step_runs_a_part_of_its_suite_and_names_one_step():
    names = [st.name for s in SUITES for st in s.steps]
    assert len(names) == len(set(names))   # --with and --limit name a step alone
    for s in SUITES:
        assert s.steps, s.name
        assert {st.part for st in s.steps} <= {p.name for p in s.parts}, s.name


def test_a_steps_extra_flags_go_before_the_flags_it_passes_on(tmp_path):
    from bench.runner import command
    serve = suites.suite("serve")
    step = next(st for st in serve.steps if st.name == "serve_overhead")
    cmd = command(serve, step, tmp_path, "--seed 3")
    assert cmd[cmd.index("--seed"):cmd.index("--seed") + 3] == ["--seed", "3", "--"]


def test_a_step_runs_in_its_own_process_and_one_past_its_limit_is_ended(tmp_path):
    assert main(["run-all", "vae:vae_flops", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "vae_flops.json").is_file() and (tmp_path / "vae_flops.log").is_file()
    assert main(["run-all", "vae:vae_flops", "--out", str(tmp_path), "--limit", "vae_flops=0.2"]) == 1
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split(" ")[:2] for line in summary] == [["vae_flops", "rc=0"], ["vae_flops", "rc=124"]]


def test_every_suite_help_gives_each_part_and_its_usage(capsys):
    for s in SUITES:
        assert main([s.name, "--help"]) == 0, s.name
        out = capsys.readouterr().out
        for part in s.parts:
            assert f"(python -m {' '.join((part.module, *part.args))})" in out, (s.name, part.name)
        assert out.count("usage: ") == 1 + len(s.parts), s.name   # the suite's, then each part's own


def _bench(tmp_path, *argv):
    """`python -m bench ARGV --out F` in its own process (the CPU paths set the interpreter and threads
    for the process): the JSON it wrote."""
    import json
    import subprocess
    import sys
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "bench", *argv, "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m bench.") and result["device"] == "cpu" and result["torch"]
    return result


def test_the_fused_prologue_runs_at_smoke_shapes_on_the_cpu(tmp_path):
    result = _bench(tmp_path, "kernels", "prologue", "--smoke", "--repeats", "1")
    assert set(result["prologue"]) >= {"decode", "prefill"} and result["prologue"]["prefill"]["fused_us"]["n"] == 1


def test_the_wan_cache_deviation_runs_on_the_tiny_model(tmp_path):
    result = _bench(tmp_path, "step-cache", "wan-deviation", "--steps", "4", "--repeats", "1")
    caches = {row["cache"].split(" ")[0] for row in result["caches"]}
    assert caches == {"first-block", "taylorseer", "magcache", "taylor"} and len(result["caches"]) == 6
    assert all(0 < row["block_share"] <= 1 and row["rel_l2_final_latents"] >= 0 for row in result["caches"])


def test_the_lora_suite_refuses_a_flag_its_run_does_not_use(capsys):
    assert main(["lora", "--measure", "batch", "--model", "wan", "--layers", "2"]) == 2
    assert main(["lora", "--measure", "load", "--modes", "eager"]) == 2
    assert main(["lora", "--measure", "batch", "--model", "hunyuan-image3"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 3 and "--layers: --measure batch --model wan does not use it" in err[0], err
    assert "--modes: --measure load" in err[1] and "--measure batch takes one of ['wan', 'qwen-image']" in err[2]


def test_the_lora_step_and_load_run_at_the_tiny_size_on_the_cpu(tmp_path):
    step = _bench(tmp_path, "lora", "--measure", "step", "--tiny", "--modes", "eager", "--iters", "1",
                  "--repeats", "2", "--warmup", "0")
    assert set(step["cases"]) == {"eager/none", "eager/unmerged", "eager/merged"} and step["complete"]
    assert step["cases"]["eager/unmerged"]["n"] == 2 and "of_medians" in step["cases"]["eager/unmerged"]["overhead_pct"]
    # tiny Wan: 2 blocks of 10 attention and FFN linears, each pair's FLOPs 2 rows r (in + out)
    assert step["flops"]["targeted_linears"] == 20 and step["flops"]["delta_flops"] > 0
    assert step["adapter_moves_output_rel_l2"] > 1e-3 and step["merged_vs_unmerged_rel_l2"] < 1e-5
    load = _bench(tmp_path, "lora", "--measure", "load", "--tiny", "--iters", "2")
    assert load["load_ms"]["n"] == 2 and load["resident_bytes"] > 0 and load["targeted_linears"] == 20
    assert load["switch_uniform_us"]["n"] == load["switch_mixed_4_rows_us"]["n"] == 200
