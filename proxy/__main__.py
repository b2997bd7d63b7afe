"""`python -m proxy ...`: see proxy/cli.py."""

import os
import sys

from proxy.commands.tool_threads import READ_ONLY, limit_threads, threads_from_argv

if sys.argv[1:2] and sys.argv[1] in READ_ONLY:  # before numpy/torch read their pools' sizes
    limit_threads(threads_from_argv(sys.argv[2:]))

from proxy.cli import main  # noqa: E402  (after the thread pools are sized)

if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `python -m proxy inspect ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
