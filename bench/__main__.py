"""`python -m bench` (and `dtgen bench`): the benchmark suites (bench/suites.py)."""
import sys

from bench.suites import main

if __name__ == "__main__":   # rank processes re-import the main module: they must not run the suite again
    sys.exit(main())
