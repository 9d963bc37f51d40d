"""Serve HunyuanImage-3.0 over HTTP: `examples.serve` for HunyuanImage-3 checkpoints only
(kept for the commands that name it; `python -m examples.serve` picks the model from the
checkpoint). `--help` lists the flags.

    .venv/bin/python -m examples.hunyuan_serve --port 8000
"""
from __future__ import annotations

from dtgen.launch import exit_process
from examples.serve import main as serve_main


def main(argv=None) -> int:
    return serve_main(argv, prog="python -m examples.hunyuan_serve", only="hunyuan-image3")


if __name__ == "__main__":
    exit_process(main())
