"""uvicorn's h11 HTTP protocol, except that a 400 it cannot send closes the connection instead of logging a traceback.

uvicorn answers a request whose framing breaks (e.g. an illegal chunk header) with a 400 that has a body; when the
request was a HEAD, h11 refuses to send a body and the error escapes ``data_received``, which asyncio logs as a
"Fatal error" with a traceback. Here that connection is closed instead (the client sent broken framing: there is no
answer to give it). The server names this class as uvicorn's ``http`` protocol, so h11 is used whatever else is
installed.
"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class QuietH11Protocol(H11Protocol):
    """H11Protocol whose 400 for broken framing never raises."""

    def send_400_response(self, msg: str) -> None:
        try:
            super().send_400_response(msg)
        except h11.LocalProtocolError:  # h11 will not send this 400 (a HEAD request): close, as the 400 would
            self.transport.close()
