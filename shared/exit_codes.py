"""Exit codes of every `python -m proxy` command and of the worker (docs/architecture.md#exit-codes).

What it is: the one place these numbers are defined; the proxy, the worker, the tools and the
tests import them from here. What it is not: the rules for when each is used (the commands).
"""

from __future__ import annotations

EXIT_OK = 0  # done: the run finished or was stopped cleanly, the command succeeded
EXIT_FAILED = 1  # the run cannot go on (restarts used up), or a checked file fails a rule
EXIT_USAGE = 2  # bad input (options, config, arms, files): refused before anything is written
EXIT_FATAL = 3  # worker only: do not restart (NaN storm, bad config, disk); the proxy stops
