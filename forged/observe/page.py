"""The status page: one HTML file with its style and script inline, read once.

The appliance is sealed, so the page loads nothing from anywhere else, and its Content
Security Policy says so to the browser: scripts and styles only inline, requests only
to the node that served it, or to the other nodes of a pool the page is asked to show
(``?peers=HOST:PORT,...``, their read-only listeners). It polls ``/stats``, the
statistics ``forged status`` prints, and keeps the last minutes of them to draw.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                               "style-src 'unsafe-inline'; connect-src 'self' http: https:; "
                               "img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


@cache
def status_page() -> bytes:
    return files("forged.observe").joinpath("status.html").read_bytes()
