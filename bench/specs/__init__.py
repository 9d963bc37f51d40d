"""The tables of docs/performance.md, as data (rendered by `python -m bench.report`), one module a
suite of bench/suites.py: `TABLES` of each, in any order (the doc's markers place them).

runs.py: `RUNS`, every JSON a table reads (its path under bench/results/) and the command that made
it; common.py: the cells more than one suite's tables build. See bench/report.py for the cell kinds
and how to add a benchmark's figures.
"""
from bench.specs import compile, decode, dit, e2e, kernels, memory, peers, serve, step_cache, vae
from bench.specs.runs import RUNS

SUITES = (decode, dit, e2e, memory, vae, kernels, serve, compile, step_cache, peers)
TABLES = [table for suite in SUITES for table in suite.TABLES]

__all__ = ["RUNS", "TABLES"]
