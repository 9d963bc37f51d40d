"""HunyuanImage-3.0 text-to-image and image editing: `dtgen run --model hunyuan-image3` as a script.

    python -m examples.hunyuan_t2i                                    # the tiny default, one process
    python -m examples.hunyuan_t2i --help                             # every flag (models/hunyuan_image3/cli.py)

The command itself is models/hunyuan_image3/cli.py; this file keeps `python -m examples.hunyuan_t2i` working.
"""
from dtgen.launch import exit_process
from models.hunyuan_image3.cli import main as run_main

def main(argv=None) -> int:
    return run_main(argv, prog="python -m examples.hunyuan_t2i")


if __name__ == "__main__":
    exit_process(main())
