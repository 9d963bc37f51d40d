"""Qwen-Image text-to-image: `dtgen run --model qwen-image` as a script.

    python -m examples.qwen_t2i                                    # the tiny default, one process
    python -m examples.qwen_t2i --help                             # every flag (models/qwen_image/cli.py)

The command itself is models/qwen_image/cli.py; this file keeps `python -m examples.qwen_t2i` working.
"""
from dtgen.launch import exit_process
from models.qwen_image.cli import main as run_main

def main(argv=None) -> int:
    return run_main(argv, prog="python -m examples.qwen_t2i")


if __name__ == "__main__":
    exit_process(main())
