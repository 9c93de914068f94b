"""Errors that carry the request field they are about, so a server names the field without reading the message."""

from __future__ import annotations


class FieldError(Exception):
    """An error about one field of a request (``param``: a GenerationConfig field, or ``prompt``, ``n``, ...)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class FieldValueError(FieldError, ValueError):
    """A field's value is out of its range or contradicts another field."""


class FieldTypeError(FieldError, TypeError):
    """A field's value has the wrong type."""
