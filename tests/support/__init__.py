"""Test support kept out of the installed packages (pyproject installs dtgen, models, placements,
kernels and examples only): the golden harness, which reads `../shared/golden*` (golden.py); the
skip marker of the tests that run Triton kernels (triton.py); the helpers of the server tests over
real HTTP (serve.py); failures forced at a step of a server or CLI run, for the tests of the error
paths (faults.py)."""
