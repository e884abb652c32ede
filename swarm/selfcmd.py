"""The command line that runs this ``swarm`` again, in a child process."""

from __future__ import annotations

import sys


def swarm_argv(*argv: str) -> list[str]:
    """``python -P -m swarm ARGV`` with this interpreter. ``-P`` keeps the working
    directory off the child's import path: a source checkout there (without its built C
    extension, say) would otherwise shadow the installed ``swarm`` the parent runs."""
    return [sys.executable, "-P", "-m", "swarm", *argv]
