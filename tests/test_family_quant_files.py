"""Every family's tiny GGUF (``family_models``) quantised by llama.cpp itself (``llama_model_quantize``, as
``scripts/quantised_files.py`` calls it) to Q8_0 and Q4_K_M. Their rows hold 64 values, not a multiple of 256, so
llama.cpp's Q4_K_M falls back to Q5_0 for its Q4_K tensors and Q8_0 for its Q6_K ones (its rule for such rows;
K-quant blocks themselves: ``test_quant_models.py``, on a Llama with 256-value rows, and SmolLM2). Checked per family:

* the numpy reference on the file's dequantised weights has llama.cpp's argmax after every prompt token on the same
  file (but for near-ties within the two runners' activation rounding: llama.cpp quantises activations to 8 bits),
  and stays within a few percent of its logits (Phi-3: not run by llama.cpp on the tiny vocabulary, whose special
  tokens its loader needs: ``test_context_and_windows.py``);
* (slow: a build each) the compiled model, blocks kept, within 5e-3 of that reference over the prompt and 16 greedy
  steps, for the families whose blocks take a path of their own (``QUANT_COMPILED``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import family_models
import numpy as np
import pytest
from family_models import CASES
from greedy_rows import greedy_rows
from logitproc.compile.gguf_model import load_gguf
from logitproc.serve.compiled_model import CompiledModel
from logitproc.serve.numpy_llama import NumpyLlama

pytest.importorskip("transformers")
llama_cpp = pytest.importorskip("llama_cpp")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "quantised_files.py"
PROMPT = [0, 1, 5, 80, 91, 7, 200, 150, 12, 260, 33, 101, 2, 45, 46, 47, 3, 270]
DECODE_STEPS = 16
TOL = 5e-3  # the compiled model's 16-bit activation codes against the float reference (test_quant_models.py)
FILE_TYPES = ["Q8_0", "Q4_K_M"]


@pytest.fixture(scope="module")
def quantised(tmp_path_factory: pytest.TempPathFactory):
    """``(family, file_type) -> path``, each file quantised once."""
    spec = importlib.util.spec_from_file_location("quantised_files", SCRIPT)
    assert spec is not None and spec.loader is not None
    files = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(files)
    root = tmp_path_factory.mktemp("family-quant")

    def get(name: str, file_type: str) -> Path:
        f32, path = root / f"{name}.F32.gguf", root / f"{name}.{file_type}.gguf"
        if not f32.exists():
            family_models.write_gguf(family_models.build_transformers_model(CASES[name]), CASES[name], f32)
        return path if path.exists() else files.llama_quantize(f32, path, file_type)

    return get


#: llama.cpp's ``phi3`` vocabulary loader needs Phi-3's own special tokens, which the tiny vocabulary lacks
LLAMA_CPP_CASES = [name for name in CASES if name != "phi3"]


@pytest.mark.parametrize("file_type", FILE_TYPES)
@pytest.mark.parametrize("name", LLAMA_CPP_CASES)
def test_quantised_file_reads_as_llama_cpp_reads_it(quantised, name: str, file_type: str) -> None:
    path = quantised(name, file_type)
    model = load_gguf(path)
    assert {kind for kind in model.tensor_types.values() if kind != "F32"}, model.tensor_types
    ours = NumpyLlama(model).extend_all(PROMPT)
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=64, n_threads=2, verbose=False)
    llm.eval(PROMPT)
    theirs = np.asarray(llm.scores[: len(PROMPT)], np.float32)
    assert 1.5 < theirs.std() < 3
    mine = ours.argmax(axis=1)
    gap = theirs.max(axis=1) - theirs[np.arange(len(mine)), mine]
    assert (gap <= 2 * np.abs(ours - theirs).max()).all(), gap
    assert (mine == theirs.argmax(axis=1)).mean() >= 0.85, (mine, theirs.argmax(axis=1))
    assert np.abs(ours - theirs).mean() < 0.05 * theirs.std()


#: The families whose quantised file is compiled too (``slow``, a build each): those whose quantised blocks take a path
#: of their own through the loader and the graph: Llama's q/k rows un-permuted block by block, Phi-3's fused q/k/v and
#: gate/up blocks split, Gemma 3's tied embedding read from its blocks as the output head (with its sliding and global
#: layers). Qwen2's biases, Qwen3's QK-norm and Gemma 2's soft-caps act on the matmuls' float outputs, as in their
#: float32 builds (test_model_families), and the blocks' kernels are the same for every family (test_quant_matvec,
#: test_quant_models' tiny Llama in each type): their builds (about 10 s of CPU each cold, 2026-11-28) checked nothing
#: more.
QUANT_COMPILED = ("llama3", "phi3", "gemma3")


@pytest.mark.slow
@pytest.mark.parametrize("name", QUANT_COMPILED)
def test_compiled_quantised_file_matches_the_numpy_reference(quantised, name: str) -> None:
    path = quantised(name, "Q4_K_M")
    compiled = CompiledModel.open(path, kv_dtype="float32", max_num_sequences=2)
    assert not [f for f in compiled.weight_formats.values() if "float" in f], compiled.weight_formats
    rows, tokens = greedy_rows(compiled, PROMPT, DECODE_STEPS)
    expected = NumpyLlama(load_gguf(path)).extend_all(tokens)[len(PROMPT) - 1:]
    np.testing.assert_allclose(rows, expected, atol=TOL, rtol=0)
