"""`python -m proxy ...`: see proxy/cli.py."""
import os
import sys

from proxy.cli import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `python -m proxy inspect ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
