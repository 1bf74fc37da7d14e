"""The ``kvstore`` command's conventions for what goes wrong, shared by every sub-command.

* An expected failure is one line on stderr, ``kvstore <command>: error: <what is wrong>``, and
  no traceback: :class:`CommandError` (raised by a command), or a ConfigError, a TraceError or a
  file that cannot be read (turned into one by ``kvstore.ops.cli.main``).
* Exit status 2: bad input (an unknown command or option, a bad value, a missing file, a folder
  that is not a kvstore tier, an empty trace); 1: the world failed (a refused connection, a
  server that answers something else); 0: done.
* Help goes to stdout (``--help``), errors to stderr.
"""

from __future__ import annotations

import argparse
import re
import sys

BAD_INPUT = 2
FAILED = 1


class CommandError(Exception):
    """An expected failure of a command: its one-line message and exit status."""

    def __init__(self, message: str, code: int = BAD_INPUT):
        super().__init__(message)
        self.code = code


def plain(doc: str | None) -> str | None:
    """A module docstring as ``--help`` prints it: reST's ````x```` as `x`, ``:mod:`x``` as `x`."""
    if doc is None:
        return None
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", doc)
    return re.sub(r"``([^`]+)``", r"`\1`", doc)


class Parser(argparse.ArgumentParser):
    """argparse with the conventions above: a bad option or value is one line,
    ``kvstore <command>: error: ... (kvstore <command> --help)``, exit 2 (argparse prints the whole
    usage first); the description (a module docstring) printed without its reST markup."""

    def __init__(self, *args, description: str | None = None, **kw):
        super().__init__(*args, description=plain(description), **kw)

    def error(self, message: str):  # noqa: D102 - argparse's hook
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(BAD_INPUT)
