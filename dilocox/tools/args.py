"""The argument parser of every tool command: a bad argument is one `dilocox: error: ...` line and exit code 2.

`dilocox bench`, `dilocox plan` and `dilocox linkcheck` (and the linkcheck worker) parse with `ToolParser`, which
raises ValueError where argparse would print its usage and exit, so each command's `main` owns its exit code and
turns parsing errors and its own validation errors into the same single line:

    try:
        args = ToolParser(prog="dilocox plan", description=DESCRIPTION).parse_args(argv)
    except SystemExit as exc:  # --help printed the help
        return int(exc.code or 0)
    except ValueError as exc:
        return user_error(exc)
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

USER_ERROR_EXIT = 2
"""Exit code of a command given bad arguments or a bad config (the same as `dilocox train`'s)."""


class ToolParser(argparse.ArgumentParser):
    """argparse that raises ValueError instead of printing usage and exiting, so main() owns the exit code.

    The message ends with where to read more: "unrecognized arguments: --x (see `dilocox plan --help`)". `--help`
    still prints the help and raises SystemExit(0).
    """

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{message} (see `{self.prog} --help`)")


def user_error(message: object) -> int:
    """Print `dilocox: error: MESSAGE` on stderr and return `USER_ERROR_EXIT`."""
    print(f"dilocox: error: {message}", file=sys.stderr)
    return USER_ERROR_EXIT
