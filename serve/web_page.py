"""The chat page's files (``serve/static/``): read once from the installed package, served by the HTTP app at ``/``."""

from __future__ import annotations

from functools import cache
from importlib import resources

#: The page's files: name -> media type. Only these are served (no directory listing, no path from the request).
FILES = {
    "index.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
#: The page's icon, also served at ``/favicon.ico`` (where browsers and other clients look without a link).
FAVICON = "favicon.svg"


@cache
def read(name: str) -> bytes:
    """The bytes of one of the page's ``FILES``; KeyError for any other name."""
    if name not in FILES:
        raise KeyError(name)
    return resources.files("logitproc.serve").joinpath("static", name).read_bytes()
