"""Safe static hosting of the web folder: which file a GET path names, or none (404).

Refused outright (404), before the file system is asked: percent-encoded slashes,
backslashes or NULs in the raw path (`%2f`, `%5c`, `%00`), empty segments
(`//etc/passwd`), `.` and `..` segments (also once decoded: `%2e%2e`). What is left is
resolved, symlinks included, and must stay inside the folder. `/` is `index.html`; a path whose
last segment has no extension and names no file is `index.html` too (the page's own
routes); a missing file with an extension is a 404.
"""

from __future__ import annotations

import mimetypes
from html import escape
from pathlib import Path

INDEX = "index.html"
MISSING_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>motet</title></head>
<body><h1>motet is running</h1>
<p>The web folder <code>{root}</code> does not exist, so there is no page to show. The
OpenAI-compatible API is at <code>/v1</code>; see <code>/v1/models</code>.</p></body></html>
"""
# In the raw path: encoded slashes, backslashes, NULs, and empty segments (which the
# router would merge away before `path` shows them).
UNSAFE_RAW = (b"%2f", b"%5c", b"%00", b"//")


def resolve(root: Path, raw_path: bytes, path: str) -> Path | None:
    """The file to serve for a request path (`raw_path` as sent, `path` decoded)."""
    raw = raw_path.split(b"?", 1)[0].lower()
    if any(unsafe in raw for unsafe in UNSAFE_RAW) or "\\" in path or "\x00" in path:
        return None
    segments = path.split("/")[1:] if path.startswith("/") else None
    if segments is None or any(s in (".", "..") for s in segments) or "" in segments[:-1]:
        return None
    base = root.resolve()
    found = _inside(base, base / ("/".join(s for s in segments if s) or INDEX))
    if found is None:  # outside the folder (a symlink), or unresolvable
        return None
    if _is_file(found):
        return found
    if "." not in segments[-1]:
        index = _inside(base, base / INDEX)
        return index if index is not None and _is_file(index) else None
    return None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the file system: pathlib lets that one through
        return False


def _inside(base: Path, candidate: Path) -> Path | None:
    try:
        resolved = candidate.resolve()
    except (OSError, RuntimeError):  # a symlink loop, a name too long
        return None
    return resolved if resolved.is_relative_to(base) else None


def content_type(path: Path) -> str:
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"{kind}; charset=utf-8" if kind.startswith("text/") or kind.endswith("javascript") else kind


def missing_page(root: Path) -> str:
    return MISSING_PAGE.format(root=escape(str(root)))
