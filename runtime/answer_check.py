"""The finished answer against its JSON response format: parsed, then validated with ``jsonschema`` against the whole
schema (the draft it declares; 2020-12 when it declares none), whatever the grammar enforced while generating.

    check_answer(fmt, text) -> AnswerCheck(valid, error) | None        None: not a JSON response format

``format`` stays an annotation (as the JSON Schema spec has it): it is not checked here and never makes an answer
invalid. An answer cut by ``max_tokens`` is usually not a whole document: it is reported invalid, with why. Nothing
is fetched: a schema that refers outside itself (``$ref`` to a URL) cannot be checked (``valid`` None, and why).
``check_answer`` never raises: an answer or a schema that the checker cannot handle (one nested deeper than Python's
recursion allows, e.g. a recursive schema and an answer nested ~1,000 deep) is reported not checked (``valid`` None,
and why), since the check runs when the answer has already ended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .response_format import ResponseFormat


@dataclass(frozen=True)
class AnswerCheck:
    """``valid``: the text is a JSON document that the schema accepts; ``error`` says why not (the first error), or
    why it could not be checked (``valid`` None)."""

    valid: bool | None
    error: str | None = None


def load_checker() -> None:
    """Import the checker (``jsonschema``: 0.1-0.3 s) now rather than when the first answer is checked, which is
    inside a step (``Engine.prepare_constraints``)."""
    import jsonschema  # noqa: F401
    import referencing.exceptions  # noqa: F401


def check_answer(fmt: ResponseFormat | None, text: str) -> AnswerCheck | None:
    """Validate ``text`` against a json_object / json_schema format; None for other formats (regexes and grammars
    are enforced exactly while generating). Never raises (what cannot be checked says so)."""
    if fmt is None or fmt.kind not in ("json_object", "json_schema"):
        return None
    try:
        return _check(fmt, text)
    except RecursionError:
        return AnswerCheck(None, "not checked: the answer or the schema nests deeper than the checker can follow")
    except Exception as err:  # a checker fault must not keep the answer from ending
        return AnswerCheck(None, f"not checked: {type(err).__name__}: {str(err)[:200]}")


def _check(fmt: ResponseFormat, text: str) -> AnswerCheck:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        return AnswerCheck(False, f"not a JSON document: {err}")
    if fmt.kind == "json_object":
        return AnswerCheck(True) if isinstance(document, dict) else AnswerCheck(
            False, f"not a JSON object: a {type(document).__name__}")
    import jsonschema  # only once an answer is checked
    import referencing
    import referencing.exceptions

    schema = fmt.schema
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, registry=referencing.Registry())  # an empty registry: nothing is fetched
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    except (referencing.exceptions.Unresolvable, jsonschema.exceptions.SchemaError) as err:
        return AnswerCheck(None, f"not checked: {type(err).__name__}: {str(err)[:200]}")
    if error is None:
        return AnswerCheck(True)
    where = "/".join(str(p) for p in error.absolute_path)
    return AnswerCheck(False, f"{error.message}" + (f" (at /{where})" if where else ""))
