"""What crosses between the Ray ingress and the engine replicas (pickled by Ray): requests, answers, model facts.

A replica's ``generate`` stream yields ``Accepted`` (the engine's request ids) or ``Rejected`` first, then lists
of the engine's ``Delta`` / ``RequestFailed`` items (what came since the last list), then one ``MetricsSnapshot``
(the replica's Prometheus text, for the ingress's ``/metrics``). A replica also sends its ``MetricsSnapshot`` to the
ingress every few seconds from the moment it is up, and ``ReplicaLeft`` when Ray stops it. No Ray import here: the
ingress and the replicas share these plain dataclasses.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineRequest:
    """One HTTP request's engine requests: one per prompt (token ids), all with ``config``."""

    prompts: tuple[tuple[int, ...], ...]
    config: Any  # GenerationConfig
    chat: bool
    jump_forward: bool | None = None


@dataclass(frozen=True)
class Accepted:
    """The replica's engine took the request: its ids there, one per prompt."""

    request_ids: tuple[str, ...]


class Refusal(enum.Enum):
    """Why a replica refused a request, as the HTTP status the app answers with."""

    QUEUE_FULL = 429  # engine_loop.QueueFull
    UNAVAILABLE = 503  # engine_loop.EngineUnavailable
    INVALID = 400  # the engine's ValueError / TypeError: the client's input


@dataclass(frozen=True)
class Rejected:
    """The replica refused the request (nothing of it runs)."""

    reason: Refusal
    message: str
    param: str | None = None  # the field an invalid request's error names (``FieldError.param``)


@dataclass(frozen=True)
class MetricsSnapshot:
    """A replica's metrics (Prometheus text), taken when one of its requests ended, or its periodic report."""

    replica: str
    text: bytes


@dataclass(frozen=True)
class ReplicaLeft:
    """A replica that Ray stops (scaled down, replaced, the application deleted): its metrics leave ``/metrics``."""

    replica: str


@dataclass(frozen=True)
class ModelFacts:
    """What the ingress needs to know of the model the replicas serve: to tokenize, check limits and answer
    ``/v1/models`` and ``/props`` without loading it."""

    name: str
    tokenizer_json: str
    chat_template: tuple[str, str | None, str | None, str]  # ChatTemplate's source, bos, eos, origin
    vocab_size: int
    context_length: int
    max_total_tokens: int
    jump_forward: bool
    speculative: Any  # SpeculativeConfig or None
    sampling_defaults: dict[str, Any]
    defaults_described: str
    max_batch: int
