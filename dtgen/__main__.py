"""`python -m dtgen`: the `dtgen` command (dtgen/cli.py)."""
from dtgen.cli import main
from dtgen.launch import exit_process

if __name__ == "__main__":   # rank processes re-import the main module: they must not run the command
    exit_process(main())
