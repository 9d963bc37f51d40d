"""Wan text-to-video (Wan 2.1, Wan 2.2-A14B): `dtgen run --model wan` as a script.

    python -m examples.wan_t2v                                    # the tiny default, one process
    python -m examples.wan_t2v --help                             # every flag (models/wan/cli.py)

The command itself is models/wan/cli.py; this file keeps `python -m examples.wan_t2v` working.
"""
from dtgen.launch import exit_process
from models.wan.cli import main as run_main

def main(argv=None) -> int:
    return run_main(argv, prog="python -m examples.wan_t2v")


if __name__ == "__main__":
    exit_process(main())
