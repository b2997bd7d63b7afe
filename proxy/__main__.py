"""`python -m proxy ...`: see proxy/cli.py."""
import sys

from proxy.cli import main

if __name__ == "__main__":
    sys.exit(main())
