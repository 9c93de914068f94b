"""``CompiledModel``: a model compiled by ``logitproc.compile.model_compile`` run in TVM's Relax VM on the CPU.

::

    model = CompiledModel.open("default")          # compiles on first use (cached), loads the VM and the weights
    model.add_sequence(0)
    logits = model.prefill([0], [model.tokenizer.encode(prompt).ids])     # [1, vocab] float32
    logits = model.decode([0], [int(logits[0].argmax())])
    processor = LogitProcessor(model.kernel_library, model.vocab_size, 64)  # kernels from the same library

The interface and its checks are ``logitproc.serve.runner.ModelRunner``'s; the sequences live in TVM's paged KV
cache (``vm.builtin.kv_state_*``): a fork shares the parent's pages (up to any position), ``popn`` drops tokens
from the end. Prompts longer than ``prefill_chunk_size`` tokens in all are processed in several forward passes of
at most that many.

Accuracy against ``NumpyLlama`` (float32 weights, dequantised from the GGUF): with ``weight_dtype="auto"`` (the
default) a GGUF's Q4_1/Q8_0 matrices are kept in their blocks and decoded inside the matmuls, so the model computes
with exactly the numpy reference's weights: logits within 1e-3 (measured 1.1e-4 on SmolLM2). Matrices stored as
float16 (``auto`` for non-quantised tensors, e.g. the tiny test model, or ``weight_dtype="float16"``): within
2e-2 on the tiny model (measured 7e-3), about 3e-2 on SmolLM2. ``weight_dtype="float32"``: within 1e-4 (with
``kv_dtype="float32"``, the default). With ``kv_dtype="float16"`` (llama.cpp's default) q, k, v and the
attention's output are rounded to it, as ``NumpyLlama(kv_dtype="float16")`` rounds them; ``kv_dtype="q8_0"``
(llama.cpp's ``-ctk q8_0 -ctv q8_0``) rounds them so too and keeps k and v in 8-bit blocks
(``compile/kv_layout.py``), as ``NumpyLlama(kv_dtype="q8_0")`` quantises them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from logitproc.compile.gguf_model import GGUFModel, LlamaConfig
from logitproc.compile.model_compile import PARAMS_FILE, TOKENIZER_FILE, Progress, compile_model
from logitproc.compile.relax_llama import DEFAULT_ACTIVATION_BITS, DEFAULT_KV_DTYPE
from logitproc.runtime.kernel_library import MANIFEST, KernelLibrary
from tokenizers import Tokenizer
from tvm import relax

from .chat_template import ChatTemplate
from .host_weights import weight_tensor
from .runner import ModelRunner

_PAGE_SIZE = 16


def _shape(values: list[int]) -> Any:
    return tvm.runtime.ShapeTuple([int(v) for v in values])


def _host(logits: Any) -> np.ndarray:
    """The logits a forward returned, as a numpy array over the same memory (the model runs on the CPU): no copy. The
    array keeps the VM's output tensor alive, and the VM never hands an output's storage to a later call."""
    return np.from_dlpack(logits)


def _chat_template(info: dict[str, Any], directory: Path) -> ChatTemplate:
    """The manifest's chat template (the model's own, or ChatML when it has none)."""
    chat = info.get("chat")
    if not isinstance(chat, dict):
        raise ValueError(f"{directory} was compiled by an older logitproc (its manifest has no chat template): "
                         "compile the model again")
    return ChatTemplate.for_model(chat["template"], chat["bos_token"], chat["eos_token"])


#: Tokens of one prefill pass (``prefill_chunk_size``'s default). A pass's matmuls cost more per token from a few
#: hundred tokens on: the 1B-shaped Q4_K_M's 1024-token prefill took 16.5-17.8 s of CPU (one thread) in passes of
#: 512, 14.2 in passes of 256 and 13.8-15.2 in passes of 128; SmolLM2 Q4_0 1.915 / 1.891 / 1.886 s
#: (docs/model.md, issue 30).
PREFILL_CHUNK = 256


class CompiledModel(ModelRunner):
    """A compiled Llama-family model with a paged KV cache (see the module doc and ``ModelRunner``)."""

    def __init__(self, directory: str | os.PathLike[str], *, max_num_sequences: int = 16,
                 max_total_tokens: int | None = None, prefill_chunk_size: int = PREFILL_CHUNK) -> None:
        started = time.perf_counter()
        self.directory = Path(directory)
        self.manifest = json.loads((self.directory / MANIFEST).read_text())
        if self.manifest.get("kind") != "model":
            raise ValueError(f"{self.directory} is not a compiled model (no 'kind': 'model' in its manifest)")
        info = self.manifest["model"]
        config = LlamaConfig.from_dict(info["config"])
        max_total = int(max_total_tokens or min(config.context, 8192))
        if max_num_sequences < 1 or max_total < 1 or prefill_chunk_size < 1:
            raise ValueError("max_num_sequences, max_total_tokens and prefill_chunk_size must be positive")
        super().__init__(
            config=config, tokenizer=Tokenizer.from_file(str(self.directory / TOKENIZER_FILE)),
            eos_token_ids=info["eos_token_ids"], name=info["name"], max_num_sequences=max_num_sequences,
            context_length=min(config.context, max_total), max_total_tokens=max_total,
            chat_template=_chat_template(info, self.directory),
        )
        self.prefill_chunk_size = int(prefill_chunk_size)
        self.kernel_library = KernelLibrary.load(self.directory)
        self.device = tvm.cpu()
        self._vm = relax.VirtualMachine(self.kernel_library.runtime_module, self.device)
        with np.load(self.directory / PARAMS_FILE) as stored:
            self._params = [weight_tensor(stored[name]) for name in self.manifest["params"]]
        self._embed, self._prefill_fn, self._decode_fn = self._vm["embed"], self._vm["prefill"], self._vm["decode"]
        self._verify_fn = self._vm["verify"]
        # Pages are per sequence: each may leave its last page partly empty, so the cache gets one page per sequence
        # on top of ``max_total`` tokens (any split of max_total tokens over the sequences then fits).
        self._kv = self._vm["create_paged_kv_cache"](
            _shape([max_num_sequences]), _shape([max_total + max_num_sequences * _PAGE_SIZE]),
            _shape([self.prefill_chunk_size]),
            _shape([_PAGE_SIZE]), _shape([0]))
        get = tvm.get_global_func
        self._kv_add = get("vm.builtin.kv_state_add_sequence")
        self._kv_remove = get("vm.builtin.kv_state_remove_sequence")
        self._kv_fork = get("vm.builtin.kv_state_fork_sequence")
        self._kv_popn = get("vm.builtin.kv_state_popn")
        self._kv_begin = get("vm.builtin.kv_state_begin_forward")
        self._kv_end = get("vm.builtin.kv_state_end_forward")
        #: sequences whose last KV block may be empty (see ``_verify``)
        self._fresh_block: set[int] = set()
        self.open_seconds = time.perf_counter() - started

    @classmethod
    def open(cls, model: str | os.PathLike[str] | GGUFModel | None = "default", target: str = "cpu",
             progress: Progress | None = None, *, weight_dtype: str = "auto", kv_dtype: str = DEFAULT_KV_DTYPE,
             context: int | None = None, activation_bits: int = DEFAULT_ACTIVATION_BITS, max_num_sequences: int = 16,
             max_total_tokens: int | None = None, prefill_chunk_size: int = PREFILL_CHUNK) -> CompiledModel:
        """Open ``model``: ``"default"``, a GGUF file, a Hugging Face directory, a ``GGUFModel`` (compiled on first
        use into the cache, serving ``context`` tokens per sequence: ``compile_model``), or a directory written by
        ``compile_model`` / ``logitproc compile --out``."""
        if isinstance(model, str | os.PathLike) and (Path(model) / MANIFEST).is_file():
            directory = Path(model)
        else:
            directory = compile_model(model, target, progress=progress, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                      context=context, activation_bits=activation_bits)
        opened = cls(directory, max_num_sequences=max_num_sequences, max_total_tokens=max_total_tokens,
                     prefill_chunk_size=prefill_chunk_size)
        if progress is not None:
            progress(f"opened {opened.name} in {opened.open_seconds:.2f}s")
        return opened

    @property
    def kv_dtype(self) -> str:
        """The KV cache's type (``float32``, ``float16`` or ``q8_0``; builds from before the option: float32)."""
        return str(self.manifest["model"]["spec"].get("kv_dtype", "float32"))

    @property
    def activation_bits(self) -> int:
        """The bits of the activation codes in the quantised matmuls (16 or 8; builds from before the option: 16)."""
        return int(self.manifest["model"]["spec"].get("activation_bits", DEFAULT_ACTIVATION_BITS))

    @property
    def weight_formats(self) -> dict[str, str]:
        """Storage format of each weight kind (embed, qkv, o, gate_up, down, lm_head)."""
        return {kind: fmt for kind, fmt in self.manifest["model"]["spec"]["formats"]}

    def __repr__(self) -> str:
        formats = "/".join(sorted(set(self.weight_formats.values())))
        return (f"CompiledModel({self.name!r}, {formats} weights, {self.kv_dtype} KV cache, {len(self._lengths)}/"
                f"{self.max_num_sequences} sequences, {self.directory})")

    # ---------------------------------------------------------------- KV cache
    # TVM's cache keeps a sequence's tokens in blocks that start at page boundaries; a fork at a page boundary
    # starts the child (and the parent, when forked at its end) on an empty block, and popn can empty one. Those
    # are the sequences whose first token a verify must decode instead (``_verify``).
    def _add(self, seq_id: int) -> None:
        self._kv_add(self._kv, seq_id)
        self._fresh_block.add(seq_id)

    def _remove(self, seq_id: int) -> None:
        self._kv_remove(self._kv, seq_id)
        self._fresh_block.discard(seq_id)

    def _fork(self, parent: int, child: int, length: int) -> None:
        self._kv_fork(self._kv, parent, child, length)
        if length % _PAGE_SIZE == 0:
            self._fresh_block.add(child)
            if length == self._lengths[parent]:
                self._fresh_block.add(parent)

    def _popn(self, seq_id: int, n: int) -> None:
        self._kv_popn(self._kv, seq_id, n)
        if (self._lengths[seq_id] - n) % _PAGE_SIZE == 0:
            self._fresh_block.add(seq_id)

    # ---------------------------------------------------------------- forward
    def _forward(self, seq_ids: list[int], pieces: list[np.ndarray]) -> np.ndarray:
        """One prefill pass: ``pieces[i]`` appended to ``seq_ids[i]``; logits after each piece's last token."""
        lengths = [p.size for p in pieces]
        ids = tvm.runtime.tensor(np.concatenate(pieces).astype(np.int32), self.device)
        wanted = np.cumsum(lengths) - 1
        positions = tvm.runtime.tensor(wanted.astype(np.int32), self.device)
        self._kv_begin(self._kv, _shape(seq_ids), _shape(lengths))
        self._fresh_block.difference_update(seq_ids)
        try:
            logits = self._prefill_fn(ids, positions, self._kv, self._params)
        finally:
            self._kv_end(self._kv)
        return _host(logits)

    def _prefill(self, seq_ids: list[int], token_ids: list[np.ndarray]) -> np.ndarray:
        out: np.ndarray | None = None  # (only when the rows end in different passes)
        done = [0] * len(seq_ids)
        while True:  # passes of at most prefill_chunk_size tokens, each sequence at most once per pass
            budget, rows, batch, pieces = self.prefill_chunk_size, [], [], []
            for row, tokens in enumerate(token_ids):
                if done[row] < tokens.size and budget > 0:
                    take = min(tokens.size - done[row], budget)
                    rows.append(row)
                    batch.append(seq_ids[row])
                    pieces.append(tokens[done[row]: done[row] + take])
                    budget -= take
            if not rows:
                return out if out is not None else np.empty((len(seq_ids), self.vocab_size), np.float32)
            logits = self._forward(batch, pieces)
            for index, row in enumerate(rows):
                done[row] += pieces[index].size
            if len(rows) == len(seq_ids) and done == [t.size for t in token_ids]:
                return logits  # (every row ends in this pass, in order: the forward's own array, no copy)
            if out is None:
                out = np.empty((len(seq_ids), self.vocab_size), np.float32)
            for index, row in enumerate(rows):
                if done[row] == token_ids[row].size:
                    out[row] = logits[index]

    def _verify(self, seq_ids: list[int], token_ids: list[np.ndarray]) -> list[np.ndarray]:
        """Each token's logits bit for bit those a decode step gives it: the verify forward computes every row's
        attention with the decode kernel's algorithm, its sequence's new tokens continuing its last KV block
        (``prefill_attention.paged_prefill_kernel``'s exact mode). That needs a last block with a token in it
        before the forward: a sequence that may start an empty block decodes its first token first."""
        fresh = [i for i, s in enumerate(seq_ids) if s in self._fresh_block]
        first: dict[int, np.ndarray] = {}
        if fresh:
            rows = self._decode([seq_ids[i] for i in fresh], np.array([token_ids[i][0] for i in fresh], np.int32))
            first = {i: rows[k : k + 1] for k, i in enumerate(fresh)}
        rest = [(i, t[1:] if i in first else t) for i, t in enumerate(token_ids)]
        rest = [(i, t) for i, t in rest if t.size]
        logits = self._verify_passes([seq_ids[i] for i, _ in rest], [t for _, t in rest]) if rest else []
        later = {i: rows for (i, _), rows in zip(rest, logits, strict=True)}
        out = []
        for i in range(len(seq_ids)):
            parts = [p for p in (first.get(i), later.get(i)) if p is not None]
            out.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
        return out

    def _verify_passes(self, seq_ids: list[int], token_ids: list[np.ndarray]) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        start = 0
        while start < len(seq_ids):  # passes of at most prefill_chunk_size tokens, whole sequences each
            end, total = start, 0
            while end < len(seq_ids) and (end == start or total + token_ids[end].size <= self.prefill_chunk_size):
                total += token_ids[end].size
                end += 1
            if total > self.prefill_chunk_size:
                raise ValueError(f"{total} tokens to verify for one sequence exceed the prefill chunk of "
                                 f"{self.prefill_chunk_size}")
            pieces = token_ids[start:end]
            self._kv_begin(self._kv, _shape(seq_ids[start:end]), _shape([p.size for p in pieces]))
            self._fresh_block.difference_update(seq_ids[start:end])
            try:
                ids = tvm.runtime.tensor(np.concatenate(pieces).astype(np.int32), self.device)
                logits = _host(self._verify_fn(ids, self._kv, self._params))
            finally:
                self._kv_end(self._kv)
            bounds = np.cumsum([0] + [t.size for t in token_ids[start:end]])
            out.extend(logits[bounds[i] : bounds[i + 1]] for i in range(end - start))
            start = end
        return out

    def _decode(self, seq_ids: list[int], token_ids: np.ndarray) -> np.ndarray:
        self._kv_begin(self._kv, _shape(seq_ids), _shape([1] * len(seq_ids)))
        self._fresh_block.difference_update(seq_ids)
        try:
            logits = self._decode_fn(tvm.runtime.tensor(token_ids, self.device), self._kv, self._params)
        finally:
            self._kv_end(self._kv)
        return _host(logits)
