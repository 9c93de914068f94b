"""Gemma 3's multimodal checkpoints (``Gemma3ForConditionalGeneration``: 4B, 12B, 27B) read as their text model, as
llama.cpp reads them for text-only use.

A tiny random one built with transformers (``family_models.build_gemma3_multimodal``: the tiny Gemma 3 text model of
``test_model_families.py`` beside a one-layer SigLIP vision tower) and saved with ``save_pretrained`` (its layout:
``language_model.model.*``, ``vision_tower.*``, ``multi_modal_projector.*``). Checked:

* the numpy reference on the folder matches transformers' logits for text (the multimodal class's own forward)
  within 1e-4, and the compiled model over the prompt and 16 greedy steps within 1e-2;
* the vision tower's and projector's tensors are skipped with one line on stderr, naming how many;
* the modules' own tensor names (``model.language_model.*``, ``model.vision_tower.*``: a state dict saved as is) and
  the sparse ``text_config`` the published checkpoints have (most keys left to ``Gemma3TextConfig``'s defaults) read as
  the same model; the family's table of those defaults is transformers' own;
* a top-level key, text model type or tensor not understood is refused, naming it, before any compile; an image in a
  chat request is refused by the server (``test_server.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import family_models
import numpy as np
import pytest
from family_models import CASES
from greedy_rows import greedy_rows
from logitproc.compile.families.gemma3 import GEMMA3_TEXT_DEFAULTS
from logitproc.compile.hf_config import config_from_hf
from logitproc.compile.hf_model import load_hf_dir
from logitproc.compile.tokenizer_source import from_hf_dir
from logitproc.serve.compiled_model import CompiledModel
from logitproc.serve.numpy_llama import NumpyLlama

pytest.importorskip("transformers")

PROMPT = [0, 1, 5, 80, 91, 7, 200, 150, 12, 260, 33, 101, 2, 45, 46, 47, 3, 270]
DECODE_STEPS = 16
TOL_NUMPY = 1e-4
TOL_COMPILED = 1e-2


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    """(the transformers model, its folder as ``save_pretrained`` writes it, with the tiny tokenizer)."""
    model = family_models.build_gemma3_multimodal()
    folder = family_models.write_hf_folder(model, CASES["gemma3"], tmp_path_factory.mktemp("gemma3mm") / "hf")
    return model, folder


def _copy(folder: Path, to: Path, config: dict | None = None) -> Path:
    shutil.copytree(folder, to)
    if config is not None:
        (to / "config.json").write_text(json.dumps(config))
    return to


def _module_layout_sparse_config(folder: Path, to: Path) -> Path:
    """``folder`` with its tensors under the modules' own names (``model.language_model.*``, ``model.vision_tower.*``,
    ``model.multi_modal_projector.*``: transformers 4.52 on, as a state dict saved as is has them; ``save_pretrained``
    writes ``language_model.model.*``, ``vision_tower.*``, ``multi_modal_projector.*``) and its config as the
    published checkpoints spell it: ``text_config`` with only the keys that differ from ``Gemma3TextConfig``'s
    defaults, in transformers 4's RoPE spelling, the EOS list at the top only."""
    from safetensors.numpy import load_file, save_file

    _copy(folder, to)
    renames = {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
               "multi_modal_projector.": "model.multi_modal_projector.", "language_model.lm_head.": "lm_head."}
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {}
    for name, array in tensors.items():
        prefix = next(p for p in renames if name.startswith(p))
        renamed[renames[prefix] + name[len(prefix):]] = array
    assert len(renamed) == len(tensors)
    save_file(renamed, str(to / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg["text_config"]
    rope = text.pop("rope_parameters")
    text.update(rope_theta=rope["full_attention"]["rope_theta"], rope_local_base_freq=10000.0,
                rope_scaling={"rope_type": "linear", "factor": rope["full_attention"]["factor"]},
                sliding_window_pattern=3)
    for key in ("layer_types", "_sliding_window_pattern", "eos_token_id"):
        text.pop(key, None)
    sparse = {k: v for k, v in text.items() if k not in GEMMA3_TEXT_DEFAULTS or GEMMA3_TEXT_DEFAULTS[k] != v}
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "tie_word_embeddings", "dtype")}
    (to / "config.json").write_text(json.dumps({**top, "text_config": sparse, "eos_token_id": [2, 3],
                                                "torch_dtype": "float32", "transformers_version": "4.50.0.dev0"}))
    return to


def test_text_model_matches_transformers(multimodal, capsys) -> None:
    model, folder = multimodal
    loaded = load_hf_dir(folder)
    assert loaded.config.architecture == "gemma3" and loaded.config.eos_ids == (2, 3)
    assert loaded.config.window_layers == (0, 1) and loaded.config.sliding_window == 6
    lines = [line for line in capsys.readouterr().err.splitlines() if "Gemma3ForConditionalGeneration" in line]
    vision = [n for n in model.state_dict() if not n.startswith(("model.language_model.", "lm_head."))]
    assert len(lines) == 1 and f"{len(vision)} image-side tensors" in lines[0] and "skipped" in lines[0], lines
    expected = family_models.reference_logits(model, PROMPT)
    assert 1.5 < expected.std() < 3
    np.testing.assert_allclose(NumpyLlama(loaded).extend_all(PROMPT), expected, atol=TOL_NUMPY, rtol=0)


def test_compiled_text_model_matches_transformers_over_greedy_decoding(multimodal) -> None:
    model, folder = multimodal
    compiled = CompiledModel.open(folder, weight_dtype="float32", kv_dtype="float32", max_num_sequences=2)
    assert compiled.eos_token_ids[:2] == (2, 3)
    rows, tokens = greedy_rows(compiled, PROMPT, DECODE_STEPS)
    expected = family_models.reference_logits(model, tokens)[len(PROMPT) - 1:]
    np.testing.assert_allclose(rows, expected, atol=TOL_COMPILED, rtol=0)


def test_module_layout_and_a_sparse_text_config_read_the_same(multimodal, tmp_path: Path) -> None:
    _, folder = multimodal
    old = _module_layout_sparse_config(folder, tmp_path / "old")
    assert "num_attention_heads" in json.loads((old / "config.json").read_text())["text_config"]  # 4, not 8
    assert "rms_norm_eps" in json.loads((old / "config.json").read_text())["text_config"]
    new, legacy = load_hf_dir(folder), load_hf_dir(old)
    assert {k: v for k, v in vars(legacy.config).items() if k != "name"} == \
        {k: v for k, v in vars(new.config).items() if k != "name"}
    assert set(legacy.weights) == set(new.weights)
    for name, array in new.weights.items():
        np.testing.assert_array_equal(legacy.weights[name], array, err_msg=name)


def test_the_defaults_are_transformers_gemma3_text_config() -> None:
    from transformers import Gemma3TextConfig

    defaults = Gemma3TextConfig()
    rope = defaults.rope_parameters
    read = {"rope_theta": rope["full_attention"]["rope_theta"],
            "rope_local_base_freq": rope["sliding_attention"]["rope_theta"]}
    for key, value in GEMMA3_TEXT_DEFAULTS.items():
        assert read.get(key, getattr(defaults, key, None)) == value, key


def test_a_published_style_config_takes_the_defaults() -> None:
    """The text part of Gemma 3 4B's published ``config.json`` (the keys it names; the rest transformers'
    defaults): 8 heads of 256, 4 KV heads, RoPE 1e6 scaled linearly by 8 globally and 1e4 locally, 5 sliding layers
    to 1 global with a window of 1024, the EOS list of the top level."""
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
           "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
           "initializer_range": 0.02, "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
           "transformers_version": "4.50.0.dev0",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16,
                             "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    config = config_from_hf(cfg)
    assert (config.n_heads, config.n_kv_heads, config.head_dim, config.vocab) == (8, 4, 256, 262208)
    assert (config.rope_theta, config.rope_scaling, config.local_rope_theta) == (1e6, "linear", 1e4)
    assert config.rope_factors == (8.0,) * 128 and config.sm_scale == pytest.approx(256 ** -0.5)
    assert config.window_layers == tuple(i for i in range(34) if (i + 1) % 6) and config.sliding_window == 1024
    assert config.eos_ids == (1, 106) and config.bos_id == 2 and config.tied_embeddings
    assert config.context == 131072


REFUSED = [
    ({"projector_hidden_act": "gelu"}, "projector_hidden_act"),
    ({"text_config": {"model_type": "gemma2"}}, "text_config model_type 'gemma2'"),
    ({"text_config": None}, "needs its text model's config as text_config"),
    ({"bos_token_id": 5}, "bos_token_id 5 disagrees"),
]


@pytest.mark.parametrize(("change", "named"), REFUSED, ids=[c[1][:24] for c in REFUSED])
def test_a_config_not_understood_is_refused(multimodal, tmp_path: Path, change: dict, named: str) -> None:
    _, folder = multimodal
    cfg = json.loads((folder / "config.json").read_text())
    if isinstance(change.get("text_config"), dict):
        change = {"text_config": {**cfg["text_config"], **change["text_config"]}}
    if "bos_token_id" in change:
        cfg["text_config"]["bos_token_id"] = 0
    with pytest.raises(ValueError, match=named):
        load_hf_dir(_copy(folder, tmp_path / "edited", {**cfg, **change}))


def test_a_tensor_of_neither_side_is_refused(multimodal, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    _, folder = multimodal
    edited = _copy(folder, tmp_path / "edited")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.audio_tower.weight"] = np.zeros(4, np.float32)
    save_file(tensors, str(edited / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.audio_tower\.weight is neither the text model's"):
        load_hf_dir(edited)


def test_the_processor_chat_template_is_read_when_the_tokenizer_has_none(multimodal, tmp_path: Path) -> None:
    _, folder = multimodal
    edited = _copy(folder, tmp_path / "edited")
    (edited / "tokenizer_config.json").write_text("{}")
    template = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    (edited / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert from_hf_dir(edited).chat_template == template
