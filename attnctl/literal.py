"""User text shown literally: what a terminal would otherwise interpret is escaped."""

from __future__ import annotations

import unicodedata


def printable(text: str) -> str:
    """User text made safe to show: control and format characters become escapes."""
    out = []
    for char in text:
        if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(char.encode("unicode_escape").decode("ascii"))
        else:
            out.append(char)
    return "".join(out)
