"""What the HTTP app needs of the engine it serves: ``EngineClient`` (submit, abort, health) and ``ServedEngine``.

Two implementations: ``EngineLoop`` (``engine_loop.py``: the engine in this process, on its own thread) and
``RayEngineClient`` (``ray_client.py``: engine replicas behind a Ray Serve deployment handle). The app
(``http_server.Server``) is the same over either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

#: Where a request's items go (``outputs.Delta``, or ``engine_loop.RequestFailed``), from any thread.
Sink = Callable[[Any], None]


class ServedModel(Protocol):
    """The model facts the app reads: its name, its ``tokenizers.Tokenizer`` and chat template, and a chat's
    prompt ids (``runner.Runner.chat_token_ids``)."""

    name: str
    tokenizer: Any
    chat_template: Any  # ChatTemplate

    def chat_token_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                       **kwargs: Any) -> list[int]: ...


class ServedEngine(Protocol):
    """The engine facts the app reads, and tokenizing (which touches no engine state: any thread may call it)."""

    model: ServedModel
    context_length: int
    max_total_tokens: int
    vocab_size: int
    jump_forward: bool
    speculative: Any  # SpeculativeConfig or None

    def tokenize(self, prompt: Any, chat: bool | None = None) -> list[int]: ...


class EngineClient(Protocol):
    """The app's way to the engine. ``state`` is ``EngineLoop.LOADING / READY / FAILED / STOPPED``; ``engine`` is
    set once READY."""

    state: str
    error: str | None

    @property
    def engine(self) -> ServedEngine: ...

    def start(self) -> None:
        """Begin loading (or connecting); called once the app's event loop runs."""

    def stop(self) -> None:
        """Abort what is left and stop (blocking; the app calls it on a worker thread)."""

    def submit(self, prompts: Sequence[Any], config: Any, chat: bool, sink: Sink,
               jump_forward: bool | None = None) -> Future:
        """Add one request per prompt (token ids); the Future holds their ids, or QueueFull (429),
        EngineUnavailable (503), or the engine's ValueError / TypeError for a bad request (400)."""

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (finished or unknown ones are ignored)."""

    async def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``'s status code and body."""
