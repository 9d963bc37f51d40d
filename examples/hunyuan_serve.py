"""Serve HunyuanImage-3.0 over HTTP: `dtgen serve` for HunyuanImage-3 checkpoints only (kept for
the commands that name it; `dtgen serve` picks the model from the checkpoint).

    python -m examples.hunyuan_serve --port 8000
"""
from dtgen.cli import serve_main
from dtgen.launch import exit_process


def main(argv=None) -> int:
    return serve_main(argv, prog="python -m examples.hunyuan_serve", only="hunyuan-image3")


if __name__ == "__main__":
    exit_process(main())
