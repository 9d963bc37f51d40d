"""`python -m bench`: the benchmark suites (bench/suites.py)."""
import sys

from bench.suites import main

sys.exit(main())
