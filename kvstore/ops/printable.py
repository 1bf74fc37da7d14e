"""How the commands print a string they did not write (a request's tag or session, a label read
from a server, a reason from a trace): as text that cannot drive the terminal.

Every character that is not printable (``str.isprintable``: control characters such as ESC and
newline, format characters such as a right-to-left override, line and paragraph separators) is
shown as its escape (``\\x1b``, ``\\n``, ``\\u202e``), and a backslash as ``\\\\``, so an escape
seen is never a character the string held; ``|`` is ``\\|`` in a Markdown table cell. The server
side already refuses such tags and sessions (kvstore.offload.hints); this is for what it did not
write: an older trace, another exporter on the port, a hand-made file.
"""

from __future__ import annotations


def printable(s: object, most: int | None = None) -> str:
    """``s`` (made a str) with every non-printable character and backslash escaped; cut to
    ``most`` characters first, ``...`` marking the cut."""
    s = str(s)
    cut = most is not None and len(s) > most
    text = s[:most] if cut else s
    if not text.isprintable() or "\\" in text:
        text = "".join(c if c.isprintable() and c != "\\" else _escape(c) for c in text)
    return text + ("..." if cut else "")


def cell(s: object, most: int | None = 64) -> str:
    """``s`` for a Markdown table cell: printable, and its ``|`` escaped."""
    return printable(s, most).replace("|", "\\|")


_SHORT = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    if c in _SHORT:
        return _SHORT[c]
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"
