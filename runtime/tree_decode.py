"""Tree decode: the next token is constrained by a "prefix -> candidate tokens" map (RTP-LLM's file format).

The file is JSON::

    {"start_token_id": 225, "end_token_id": 2, "sep": "_",
     "prefix_dict": {"225": [64000, 64005], "225_64000": [64001, 64002], "225_64000_64001": [2]}}

A sequence's state is the start token followed by the tokens it has generated, written as a key
``"{start}{sep}{t0}{sep}{t1}..."``; ``prefix_dict[key]`` lists the tokens allowed next. The key ``"{start}"`` alone
gives the candidates of the first generated token. A key that is not in the map (or maps to an empty list) allows
only ``end_token_id``. ``sep`` defaults to ``"_"``; the other three fields are required.

Semantics fixed here (where the format leaves room):

- A committed token that has no key below the current one (it was not a candidate, or the file has no entry for the
  longer prefix) leaves the tree: from then on only ``end_token_id`` is allowed.
- After ``end_token_id`` is committed the sequence is finished: only ``end_token_id`` stays allowed (for a
  multi-sequence request whose other sequences go on), and later tokens do not move the state.
- Keys are checked strictly at load: the start token, then canonical decimal token ids (no sign, no leading zeros,
  exactly what the runtime writes) separated by ``sep``; every id in a key or a candidate list must lie in
  ``[0, vocab_size)``; a key must not continue after ``end_token_id`` (that prefix could never be reached).
  Every error names the file, the key and what is wrong.

The map is compiled once into a trie (one dict per node, token -> child). Each node holds its bitmask row
(int32 ``[ceil(V/32)]``), built at load in one vectorised pass; nodes with the same candidate set share one row, so
memory is ``distinct candidate sets x V / 8`` bytes. Per step, ``fill_bitmask`` walks the draft path through the
dicts and copies one row: nothing proportional to the vocabulary runs in Python.

Very large maps (recommendation-style trees with millions of prefixes) would need gigabytes of dense rows: when the
dense table would exceed ``max_mask_bytes`` (default 512 MiB) the rows are stored sparse instead (the non-zero words
of each candidate set, CSR), and ``fill_bitmask`` zeroes the row and scatters those words (still O(1) Python work).
The load log says which layout was chosen.

Configuration: ``--tree-decode-config FILE`` wins over the ``TREE_DECODE_CONFIG`` environment variable. The command
line's path is the user's own choice, taken as given (absolute, or relative to the working directory). The
environment variable's path resolves against the model directory, and one that leaves it (``..``, a symlink, an
absolute path elsewhere) is refused (:func:`resolve_tree_decode_config`): a deployment sets it once for a model.
docs/constrained_decoding.md has a worked example.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .mask_source import NeverForces

logger = logging.getLogger("logitproc.tree_decode")

ENV_VAR = "TREE_DECODE_CONFIG"
CLI_FLAG = "--tree-decode-config"
DEFAULT_SEP = "_"
DEFAULT_MAX_MASK_BYTES = 512 << 20
_REQUIRED = ("start_token_id", "end_token_id", "prefix_dict")
_KNOWN = (*_REQUIRED, "sep")


class TreeDecodeConfigError(ValueError):
    """A tree decode file that cannot be used: unreadable, malformed, out of the vocabulary, or outside the model."""


class _Node:
    """One prefix: its children by next token and its precomputed mask.

    ``mask`` is the node's bitmask row (a read-only view into the shared dense table, shared by every node with the
    same candidate set), or, in the sparse layout, the index of its candidate set in the CSR arrays.
    """

    __slots__ = ("children", "mask")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.mask: np.ndarray | int = 0


# ---- paths ------------------------------------------------------------------------------------------------------

def _resolve_path(value: str | os.PathLike[str], model_dir: str | os.PathLike[str] | None) -> Path:
    """The file ``value`` names: relative to ``model_dir`` and confined to it, or as given when there is none."""
    raw = Path(value)
    if str(value) == "":
        raise TreeDecodeConfigError("tree decode config: the path is empty")
    if model_dir is None:
        path = raw.expanduser()
        if not path.is_file():
            raise TreeDecodeConfigError(f"tree decode config {str(value)!r}: no such file")
        return path.resolve()
    base = Path(model_dir)
    if not base.is_dir():
        raise TreeDecodeConfigError(f"tree decode config {str(value)!r}: the model directory {str(base)!r} "
                                    "does not exist")
    base_real = base.resolve(strict=True)
    candidate = raw if raw.is_absolute() else base / raw
    real = candidate.resolve()  # follows every symlink and '..'
    if not real.is_relative_to(base_real):
        raise TreeDecodeConfigError(
            f"tree decode config {str(value)!r} resolves to {str(real)!r}, outside the model directory "
            f"{str(base_real)!r}; the file must lie inside the model directory ('..', symlinks and absolute paths "
            "that leave it are refused)")
    if not real.is_file():
        raise TreeDecodeConfigError(f"tree decode config {str(value)!r}: no such file in the model directory "
                                    f"{str(base_real)!r}")
    return real


def resolve_tree_decode_config(cli_value: str | None, env: Mapping[str, str] | None = None,
                               model_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The tree decode file to load, or None when none is configured.

    ``cli_value`` (the ``--tree-decode-config`` argument) wins over ``env["TREE_DECODE_CONFIG"]`` (``env`` defaults
    to ``os.environ``); an empty value counts as unset. ``cli_value`` is taken as given (absolute, or relative to
    the working directory). The environment's value resolves against ``model_dir``, and a path that leaves
    ``model_dir`` is refused with :class:`TreeDecodeConfigError`; without a ``model_dir`` it is taken as given.
    """
    env = os.environ if env is None else env
    if cli_value:
        value, origin, base = cli_value, CLI_FLAG, None
    elif env.get(ENV_VAR):
        value, origin, base = env[ENV_VAR], ENV_VAR, model_dir
    else:
        return None
    try:
        return _resolve_path(value, base)
    except TreeDecodeConfigError as err:
        raise TreeDecodeConfigError(f"{origin}: {err}") from None


def load_tree_decode_config(cli_value: str | None, vocab_size: int, env: Mapping[str, str] | None = None,
                            model_dir: str | os.PathLike[str] | None = None) -> TreeDecodeConfig | None:
    """Resolve (as :func:`resolve_tree_decode_config`) and load the configured file; None when none is configured."""
    path = resolve_tree_decode_config(cli_value, env, model_dir)
    return None if path is None else TreeDecodeConfig.load(path, vocab_size)


# ---- the compiled map -------------------------------------------------------------------------------------------

def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise TreeDecodeConfigError(f"key {key!r} appears more than once")
        out[key] = value
    return out


@dataclass(frozen=True, eq=False)
class TreeDecodeConfig:
    """A loaded and compiled tree decode map for one vocabulary size. Immutable; shared by every sequence."""

    start_token_id: int
    end_token_id: int
    sep: str
    vocab_size: int
    num_prefixes: int
    num_candidate_tokens: int
    source: str = "<dict>"
    _root: _Node = field(default_factory=_Node, repr=False)
    _end_only: _Node = field(default_factory=_Node, repr=False)
    num_distinct_masks: int = 0
    sparse: bool = False
    mask_bytes: int = 0
    _words: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)  # sparse layout: CSR
    _bits: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32), repr=False)
    _offsets: list[int] = field(default_factory=list, repr=False)

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def fill_row(self, row: np.ndarray, node: _Node) -> None:
        """Write ``node``'s mask into ``row`` (int32 ``[bitmask_words]``)."""
        if row.shape != (self.bitmask_words,):
            raise ValueError(f"tree decode: bitmask row has shape {row.shape} but the tree was loaded for "
                             f"vocab_size={self.vocab_size} ({self.bitmask_words} words)")
        mask = node.mask
        if mask.__class__ is int:
            lo, hi = self._offsets[mask], self._offsets[mask + 1]  # type: ignore[index,operator]
            row.fill(0)
            row.view(np.uint32)[self._words[lo:hi]] = self._bits[lo:hi]
        else:
            np.copyto(row, mask)

    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str], vocab_size: int, model_dir: str | os.PathLike[str] | None = None,
             max_mask_bytes: int = DEFAULT_MAX_MASK_BYTES) -> TreeDecodeConfig:
        """Read, check and compile the file at ``path`` (relative to and confined to ``model_dir`` when given)."""
        resolved = _resolve_path(path, model_dir)
        try:
            text = resolved.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise TreeDecodeConfigError(f"tree decode config {str(resolved)!r}: cannot read it: {err}") from None
        try:
            data = json.loads(text, object_pairs_hook=_reject_duplicates)
        except json.JSONDecodeError as err:
            raise TreeDecodeConfigError(f"tree decode config {str(resolved)!r} is not valid JSON: {err}") from None
        except TreeDecodeConfigError as err:
            raise TreeDecodeConfigError(f"tree decode config {str(resolved)!r}: {err}") from None
        config = cls.from_dict(data, vocab_size, source=str(resolved), max_mask_bytes=max_mask_bytes)
        logger.info("loaded tree decode config %s: %d prefixes, %d candidate tokens, %d distinct masks (%s, %d bytes),"
                    " start_token_id=%d, end_token_id=%d, vocab_size=%d", resolved, config.num_prefixes,
                    config.num_candidate_tokens, config.num_distinct_masks, "sparse" if config.sparse else "dense",
                    config.mask_bytes, config.start_token_id, config.end_token_id, vocab_size)
        return config

    @classmethod
    def from_dict(cls, data: Any, vocab_size: int, source: str = "<dict>",
                  max_mask_bytes: int = DEFAULT_MAX_MASK_BYTES) -> TreeDecodeConfig:
        """Check and compile an already parsed map (the JSON object of the file format)."""
        where = f"tree decode config {source!r}"
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise TreeDecodeConfigError(f"{where}: vocab_size must be an int >= 1, got {vocab_size!r}")
        if not isinstance(data, dict):
            raise TreeDecodeConfigError(f"{where}: the top level must be a JSON object, got {type(data).__name__}")
        for name in _REQUIRED:
            if name not in data:
                raise TreeDecodeConfigError(f"{where}: missing field {name!r} (required: {', '.join(_REQUIRED)})")
        unknown = sorted(set(data) - set(_KNOWN))
        if unknown:
            logger.warning("%s: ignoring unknown fields %s", where, unknown)
        for name in ("start_token_id", "end_token_id"):
            value = data[name]
            if not _token_id(value):
                raise TreeDecodeConfigError(f"{where}: field {name!r} must be an integer token id, got {value!r} "
                                            f"({type(value).__name__})")
            if not 0 <= value < vocab_size:
                raise TreeDecodeConfigError(f"{where}: field {name!r} = {value} is outside the vocabulary "
                                            f"[0, {vocab_size})")
        start, end = int(data["start_token_id"]), int(data["end_token_id"])
        sep = data.get("sep", DEFAULT_SEP)
        if not isinstance(sep, str) or not sep or any(c.isdigit() for c in sep):
            raise TreeDecodeConfigError(f"{where}: field 'sep' must be a non-empty string without digits, got "
                                        f"{sep!r}")
        prefix_dict = data["prefix_dict"]
        if not isinstance(prefix_dict, dict):
            raise TreeDecodeConfigError(f"{where}: field 'prefix_dict' must be a JSON object (prefix -> list of "
                                        f"token ids), got {type(prefix_dict).__name__}")

        root, end_only = _Node(), _Node()
        set_index: dict[tuple[int, ...], int] = {(end,): 0}  # row 0: only the end token (fallback and finished)
        node_sets: list[tuple[_Node, int]] = []
        start_text = str(start)
        num_tokens = 0
        for key, candidates in prefix_dict.items():
            path = _parse_key(key, start_text, sep, end, vocab_size, where)
            ids = _parse_candidates(key, candidates, vocab_size, where)
            num_tokens += len(ids)
            node = root
            for token in path:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                node = child
            unique = tuple(sorted(set(ids))) or (end,)  # an empty list behaves as a missing key
            node_sets.append((node, set_index.setdefault(unique, len(set_index))))

        words = (vocab_size + 31) // 32
        count = len(set_index)
        sizes = np.fromiter((len(c) for c in set_index), np.int64, count)
        tokens = np.fromiter((t for c in set_index for t in c), np.int64, int(sizes.sum()))
        owner = np.repeat(np.arange(count, dtype=np.int64), sizes)
        bits = np.uint32(1) << (tokens & 31).astype(np.uint32)
        sparse = count * words * 4 > max_mask_bytes
        masks: list[np.ndarray] | list[int]
        if sparse:  # CSR over (candidate set, non-zero word); np.unique sorts the keys by set, then word
            keys, inverse = np.unique(owner * words + (tokens >> 5), return_inverse=True)
            csr_bits = np.zeros(keys.size, np.uint32)
            np.bitwise_or.at(csr_bits, inverse, bits)
            csr_words = keys % words
            offsets = np.searchsorted(keys // words, np.arange(count + 1)).tolist()
            masks = list(range(count))
            mask_bytes = int(csr_words.nbytes + csr_bits.nbytes)
        else:
            table = np.zeros((count, words), np.int32)
            np.bitwise_or.at(table.view(np.uint32).reshape(-1), owner * words + (tokens >> 5), bits)
            table.setflags(write=False)
            masks = list(table)  # one read-only view per distinct set, shared by its nodes
            csr_words, csr_bits, offsets = np.zeros(0, np.int64), np.zeros(0, np.uint32), []
            mask_bytes = int(table.nbytes)

        stack = [root]  # every node starts on the fallback (only the end token); iterative: trees may be deep
        while stack:
            n = stack.pop()
            n.mask = masks[0]
            stack.extend(n.children.values())
        for node, index in node_sets:
            node.mask = masks[index]
        end_only.mask = masks[0]
        return cls(start, end, sep, vocab_size, len(prefix_dict), num_tokens, source, root, end_only, count, sparse,
                   mask_bytes, csr_words, csr_bits, offsets)

    # ------------------------------------------------------------------------------------------------------------
    def allowed_tokens(self, path: Sequence[int]) -> np.ndarray:
        """Token ids allowed after the generated tokens ``path`` (for inspection and tests)."""
        row = np.empty(self.bitmask_words, np.int32)
        self.fill_row(row, self.walk(self._root, path))
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: self.vocab_size]
        return np.flatnonzero(bits)

    def walk(self, node: _Node, path: Sequence[int]) -> _Node:
        """The node reached from ``node`` by ``path`` (the finished/off-tree node once it leaves the tree)."""
        end_only = self._end_only
        for token in path:
            node = node.children.get(token, end_only)
        return node

    def key(self, path: Sequence[int]) -> str:
        """The file-format key of a generated path: ``"{start}{sep}{t0}{sep}{t1}..."``."""
        return self.sep.join([str(self.start_token_id), *(str(int(t)) for t in path)])


def _parse_key(key: str, start_text: str, sep: str, end: int, vocab_size: int, where: str) -> list[int]:
    if key != start_text and not key.startswith(start_text + sep):
        raise TreeDecodeConfigError(f"{where}: prefix_dict key {key!r} does not start with the start token "
                                    f"{start_text!r} followed by the separator {sep!r}")
    parts = key[len(start_text) + len(sep):].split(sep) if key != start_text else []
    path: list[int] = []
    for i, part in enumerate(parts):
        if not (part.isascii() and part.isdigit()) or (len(part) > 1 and part[0] == "0"):
            raise TreeDecodeConfigError(f"{where}: prefix_dict key {key!r}: part {i + 1} ({part!r}) is not a "
                                        "token id (a decimal integer >= 0 without sign or leading zeros)")
        token = int(part)
        if token >= vocab_size:
            raise TreeDecodeConfigError(f"{where}: prefix_dict key {key!r}: token id {token} is outside the "
                                        f"vocabulary [0, {vocab_size})")
        if token == end:
            raise TreeDecodeConfigError(f"{where}: prefix_dict key {key!r} continues after end_token_id {end}; "
                                        "generation stops at the end token, so this prefix can never be reached")
        path.append(token)
    return path


def _parse_candidates(key: str, candidates: Any, vocab_size: int, where: str) -> list[int]:
    if not isinstance(candidates, list):
        raise TreeDecodeConfigError(f"{where}: prefix_dict[{key!r}] must be a list of token ids, got "
                                    f"{type(candidates).__name__} {candidates!r}")
    for i, token in enumerate(candidates):
        if not _token_id(token):
            raise TreeDecodeConfigError(f"{where}: prefix_dict[{key!r}][{i}] must be an integer token id, got "
                                        f"{token!r} ({type(token).__name__})")
        if not 0 <= token < vocab_size:
            raise TreeDecodeConfigError(f"{where}: prefix_dict[{key!r}][{i}] = {token} is outside the vocabulary "
                                        f"[0, {vocab_size})")
    return candidates


# ---- one sequence -----------------------------------------------------------------------------------------------

class TreeDecodeSource(NeverForces):
    """The tree constraint of one sequence (a TokenMaskSource). Each sequence of an n > 1 request has its own.

    It always constrains (``fill_bitmask`` returns True): inside the tree the candidates of the current prefix, off
    the tree or after the end token only ``end_token_id``.
    """

    __slots__ = ("config", "_node", "_tokens", "_finished", "_accepted")

    def __init__(self, config: TreeDecodeConfig) -> None:
        if not isinstance(config, TreeDecodeConfig):
            raise TypeError(f"config must be a TreeDecodeConfig, got {type(config).__name__}")
        self.config = config
        self._node = config._root
        self._tokens: list[int] = []  # generated tokens up to the end token (for `key`)
        self._finished = False
        self._accepted = 0  # every accepted token, also those after the end token

    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        node = self.config.walk(self._node, draft_path) if draft_path else self._node
        self.config.fill_row(row, node)
        return True

    def accept_token(self, token_id: int) -> None:
        token = int(token_id)
        self._accepted += 1
        if self._finished:
            return
        self._tokens.append(token)
        self._node = self._node.children.get(token, self.config._end_only)
        self._finished = token == self.config.end_token_id

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (the path is walked again from the root)."""
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._accepted} were accepted")
        keep = self._accepted - num_tokens
        tokens = self._tokens[:keep]
        self._node, self._tokens, self._finished, self._accepted = self.config._root, [], False, 0
        for token in tokens:
            self.accept_token(token)
        self._accepted = keep

    def fork(self) -> TreeDecodeSource:
        """An independent copy at the same position (for a sequence that splits, e.g. n > 1 after the prompt)."""
        other = TreeDecodeSource(self.config)
        other._node, other._tokens, other._finished = self._node, list(self._tokens), self._finished
        other._accepted = self._accepted
        return other

    def __copy__(self) -> TreeDecodeSource:
        return self.fork()

    def __deepcopy__(self, memo: dict[int, Any]) -> TreeDecodeSource:
        return self.fork()  # the compiled config is immutable and shared

    @property
    def finished(self) -> bool:
        """True once the end token has been committed."""
        return self._finished

    @property
    def in_tree(self) -> bool:
        """False once a committed token left the tree (or the end token was committed): only the end token is left."""
        return self._node is not self.config._end_only

    @property
    def key(self) -> str:
        """The file-format key of the committed path (RTP-LLM's DFA status)."""
        return self.config.key(self._tokens)

    def __repr__(self) -> str:
        return f"TreeDecodeSource(key={self.key!r}, in_tree={self.in_tree}, finished={self.finished})"
