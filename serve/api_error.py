"""Errors answered in OpenAI's shape, and how a client's value is shown in their messages."""

from __future__ import annotations

import reprlib
from typing import Any


def shown(value: Any) -> str:
    """A client's value in an error message: its repr (escaped), bounded in length and depth."""
    return _REPR.repr(value)


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = _REPR.maxdict = 6
_REPR.maxlevel = 3

#: The longest error message answered.
MAX_MESSAGE_CHARS = 2000


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        """The error's JSON body (the message cut to MAX_MESSAGE_CHARS: it may quote the client's values)."""
        return {"error": {"message": self.message[:MAX_MESSAGE_CHARS], "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
