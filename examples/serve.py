"""Serve a model over HTTP: `dtgen serve` as a script (the model is the one the checkpoint holds).

    python -m examples.serve --port 8000                        # tiny HunyuanImage-3, one process
    python -m examples.serve --model wan --port 8000            # tiny Wan (video jobs)
    python -m examples.serve --model qwen-image --help          # every flag of that model's server

The command itself is dtgen/cli.py (`serve_main`); this file keeps `python -m examples.serve` working.
"""
from dtgen.cli import serve_main
from dtgen.launch import exit_process

def main(argv=None) -> int:
    return serve_main(argv, prog="python -m examples.serve")


if __name__ == "__main__":
    exit_process(main())
