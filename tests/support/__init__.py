"""Test support kept out of the installed packages (pyproject installs dtgen, models, placements,
kernels and examples only): the golden harness, which reads `../shared/golden*`."""
