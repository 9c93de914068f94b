"""Peak resident memory of a compile's weight stage (read, convert, write ``params.npz``) for a model file.

::

    python scripts/measure_load_memory.py MODEL.gguf|HF_DIR [--weight-dtype auto]
    python scripts/measure_load_memory.py --write-random OUT.gguf --hidden 2048 --layers 8 --vocab 32000

The first form runs, in this process, what ``compile_model`` does with the weights (``load_gguf`` without weights,
``read_gguf_tensors`` or ``load_hf_dir``, ``iter_relax_weights`` into ``save_params``) and prints the peak RSS above
the process's RSS before it, next to the stored weights' size and the largest tensor in float32 (the bound of
``docs/model.md``: stored weights + largest float32 tensor + a margin). ``--eager`` reads every weight into float32
first, as the loader did before (for comparison); ``--json`` prints the figures as one JSON object
(``tests/test_load_memory.py`` reads it). The second form writes a random F16 ``llama`` GGUF of the given
shape (tokens are placeholders) to measure with.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _peak_rss_mb() -> float:
    """This process's peak resident memory since its ``exec`` (``VmHWM``). Not ``getrusage``'s ``ru_maxrss``: Linux
    carries that over ``fork`` and ``exec``, so under a large parent (a test session) it reports the parent's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("/proc/self/status has no VmHWM line")


def write_random(path: Path, hidden: int, layers: int, vocab: int, ffn: int) -> None:
    import gguf

    rng = np.random.default_rng(0)
    heads = hidden // 64
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_context_length, 2048), (writer.add_embedding_length, hidden),
                       (writer.add_block_count, layers), (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, heads)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["t", "0", *(f"t{i}" for i in range(vocab - 2))])  # one merge: "t" "0" -> "t0"
    writer.add_token_merges(["t 0"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", matrix(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (hidden, hidden)), ("attn_v", (hidden, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def measure(model_path: Path, weight_dtype: str, eager: bool) -> dict[str, float]:
    """Run the weight stage on ``model_path`` in this process; its sizes and memory in MB (see the module doc)."""
    from logitproc.compile.gguf_model import load_gguf
    from logitproc.compile.hf_model import load_hf_dir
    from logitproc.compile.llama_weights import iter_relax_weights, read_gguf_tensors, save_params
    from logitproc.compile.relax_llama import LlamaSpec, export_llama
    from logitproc.runtime.targets import resolve_target

    before = _rss_mb()
    if model_path.is_dir():
        model, raw = load_hf_dir(model_path), None
    else:
        model = load_gguf(model_path, load_weights=False)
        model.weights, raw = read_gguf_tensors(model_path, model.config, keep_blocks=weight_dtype == "auto")
    largest = max(int(np.prod(model.config.tensor_shape(name))) * 4 for name in model.weights) / 1e6
    if eager:
        model.weights = dict(model.weights)
    spec = LlamaSpec.from_model(model, weight_dtype, raw)
    _, names = export_llama(spec, resolve_target("cpu").tvm_target())
    with tempfile.TemporaryDirectory() as out:
        written = save_params(Path(out) / "params.npz", iter_relax_weights(model, spec, raw), names) / 1e6
    peak = _peak_rss_mb()
    stored = sum(f.stat().st_size for f in ([model_path] if model_path.is_file() else model_path.iterdir())) / 1e6
    return {"stored_mb": stored, "written_mb": written, "largest_float32_mb": largest, "rss_before_mb": before,
            "peak_mb": peak, "rise_mb": peak - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", type=Path)
    parser.add_argument("--weight-dtype", default="auto", choices=("auto", "float16", "float32"))
    parser.add_argument("--eager", action="store_true", help="read every weight into float32 first (the old way)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object (MB)")
    parser.add_argument("--write-random", type=Path, help="write a random F16 llama GGUF here and stop")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ffn", type=int, default=5632)
    args = parser.parse_args()
    if args.write_random:
        write_random(args.write_random, args.hidden, args.layers, args.vocab, args.ffn)
    elif args.model is None:
        parser.error("name a model, or --write-random")
    else:
        result = measure(args.model, args.weight_dtype, args.eager)
        if args.json:
            print(json.dumps(result))
            return
        print(f"{args.model.name}: stored {result['stored_mb']:.0f} MB, params written {result['written_mb']:.0f} MB, "
              f"largest tensor in float32 {result['largest_float32_mb']:.0f} MB, RSS before "
              f"{result['rss_before_mb']:.0f} MB, peak {result['peak_mb']:.0f} MB (peak - before "
              f"{result['rise_mb']:.0f} MB){' [eager float32 stage]' if args.eager else ''}")


if __name__ == "__main__":
    main()
