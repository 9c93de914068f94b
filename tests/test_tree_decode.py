"""Tree decode: random trees through the real processor and sampler, drafts, malformed files, paths, precedence."""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from logitproc import GenerationConfig, LogitProcessor, RequestState, Sampler
from logitproc.runtime import DraftTree
from logitproc.runtime.tree_decode import (
    ENV_VAR,
    TreeDecodeConfig,
    TreeDecodeConfigError,
    TreeDecodeSource,
    load_tree_decode_config,
    resolve_tree_decode_config,
)
from logitproc.tir_kernels import reference as ref

V = 1000
BIG_V = 129280  # DeepSeek's vocabulary: 4040 bitmask words


# ---- helpers: random trees and the reference semantics (a plain key lookup, as RTP-LLM does) ----------------------

def random_tree(rng: np.random.Generator, vocab: int, start: int, end: int, sep: str = "_", max_depth: int = 5,
                max_branch: int = 4, pool: np.ndarray | None = None) -> dict[str, Any]:
    """A random file-format map: every node lists 1..max_branch candidates (sometimes the end token); most
    candidates have a key of their own, some do not (the fallback: only the end token)."""
    tokens = pool if pool is not None else np.setdiff1d(np.arange(vocab), [end])
    prefix_dict: dict[str, list[int]] = {}

    def grow(path: list[int], depth: int) -> None:
        key = sep.join(str(t) for t in [start, *path])
        if depth == max_depth:
            if rng.random() < 0.5:
                prefix_dict[key] = [end]
            return
        k = int(rng.integers(1, max_branch + 1))
        cands = [int(t) for t in rng.choice(tokens, k, replace=False)]
        if depth > 0 and rng.random() < 0.25:
            cands.append(end)
        prefix_dict[key] = cands
        for t in cands:
            if t != end and rng.random() < 0.85:
                grow([*path, t], depth + 1)

    grow([], 0)
    return {"start_token_id": start, "end_token_id": end, "sep": sep, "prefix_dict": prefix_dict}


def ref_allowed(data: dict[str, Any], path: Sequence[int]) -> set[int]:
    """Allowed next tokens: the key's candidates, else only the end token (also once the end token was emitted)."""
    end = data["end_token_id"]
    if end in path:
        return {end}
    key = data.get("sep", "_").join(str(t) for t in [data["start_token_id"], *path])
    return set(data["prefix_dict"].get(key) or [end])


def allowed_of(row: np.ndarray, vocab: int) -> set[int]:
    return set(np.flatnonzero(ref.unpack_bitmask(row[None, :], vocab)[0]).tolist())


def write(tmp: Path, data: Any, name: str = "tree.json") -> Path:
    path = tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def run_sequences(proc: LogitProcessor, sampler: Sampler, config: TreeDecodeConfig, data: dict[str, Any],
                  configs: Sequence[GenerationConfig], steps: int, seed: int) -> list[list[int]]:
    """Generate with random logits; every sampled token is checked against the reference at its position."""
    rng = np.random.default_rng(seed)
    states = [RequestState([7, data["start_token_id"]], c, mask_sources=[TreeDecodeSource(config)]) for c in configs]
    for _ in range(steps):
        logits = (rng.standard_normal((len(states), proc.vocab_size)) * 4).astype(np.float32)
        proc.inplace_update_logits(logits, states)
        probs = sampler.renormalize(proc.compute_probs_from_logits(logits, states), states)
        result = sampler.sample(probs, states)
        assert not result.no_valid_token.any()
        for state, token in zip(states, result.token_ids.tolist(), strict=True):
            assert token in ref_allowed(data, state.output_token_ids), (state.output_token_ids, token)
            state.append_token(token)
    return [s.output_token_ids for s in states]


def assert_tree_path(data: dict[str, Any], output: list[int]) -> None:
    end = data["end_token_id"]
    assert end in output, output
    first = output.index(end)
    assert all(t == end for t in output[first:])
    for i, t in enumerate(output[:first + 1]):
        assert t in ref_allowed(data, output[:i])


# ---- random trees through the real pipeline ---------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_random_trees_only_produce_paths_of_the_tree_then_the_end_token(proc, sampler, seed) -> None:
    rng = np.random.default_rng(seed)
    sep = ["_", "-", "::", " "][seed]
    data = random_tree(rng, V, start=int(rng.integers(V)), end=int(rng.integers(V)), sep=sep)
    config = TreeDecodeConfig.from_dict(data, V, max_mask_bytes=0 if seed % 2 else 1 << 30)
    assert config.sparse == bool(seed % 2)
    configs = [GenerationConfig(seed=seed * 100 + i, temperature=[1.0, 0.0, 2.0, 0.7][i % 4],
                                top_k=[0, 0, 2, 0][i % 4], top_p=[1.0, 1.0, 1.0, 0.8][i % 4]) for i in range(16)]
    outputs = run_sequences(proc, sampler, config, data, configs, steps=8, seed=seed)
    for out in outputs:
        assert_tree_path(data, out)
    assert max(out.index(data["end_token_id"]) for out in outputs) >= 2  # really walked into the tree


def test_big_vocabulary_masks_match_the_map_at_every_prefix(lib) -> None:
    rng = np.random.default_rng(11)
    pool = np.unique(np.concatenate([[0, 31, 32, 63, 64, BIG_V - 33, BIG_V - 32, BIG_V - 1],
                                     rng.integers(0, BIG_V, 60)]))
    end = BIG_V - 2
    data = random_tree(rng, BIG_V, start=225, end=end, max_depth=3, max_branch=6, pool=pool)
    config = TreeDecodeConfig.from_dict(data, BIG_V)
    sparse = TreeDecodeConfig.from_dict(data, BIG_V, max_mask_bytes=0)
    assert config.bitmask_words == 4040 and not config.sparse and sparse.sparse
    assert sparse.mask_bytes < config.mask_bytes // 100
    row, row_sparse = np.empty(config.bitmask_words, np.int32), np.empty(config.bitmask_words, np.int32)
    for key in [*data["prefix_dict"], "225_0_0", "225_129279"]:  # (and two keys the map does not have)
        path = [int(p) for p in key.split("_")[1:]]
        source, source_sparse = TreeDecodeSource(config), TreeDecodeSource(sparse)
        for t in path:
            source.accept_token(t)
            source_sparse.accept_token(t)
        row[:] = -1
        row_sparse[:] = -1
        assert source.fill_bitmask(row, ()) and source_sparse.fill_bitmask(row_sparse, ())
        np.testing.assert_array_equal(row, row_sparse)
        assert allowed_of(row, BIG_V) == ref_allowed(data, path), key
        assert set(config.allowed_tokens(path).tolist()) == ref_allowed(data, path)
    big_proc = LogitProcessor(lib, vocab_size=BIG_V, max_num_token=4)
    big_sampler = Sampler(lib, vocab_size=BIG_V, max_num_token=4)
    outputs = run_sequences(big_proc, big_sampler, config, data, [GenerationConfig(seed=i) for i in range(4)],
                            steps=5, seed=3)
    for out in outputs:
        assert_tree_path(data, out)


def test_each_sequence_keeps_its_own_state_and_fork_copies_it() -> None:
    data = {"start_token_id": 5, "end_token_id": 0, "prefix_dict": {"5": [1, 2], "5_1": [3], "5_2": [4, 0]}}
    config = TreeDecodeConfig.from_dict(data, 10)
    a, b = TreeDecodeSource(config), TreeDecodeSource(config)
    a.accept_token(1)
    b.accept_token(2)
    row = np.empty(1, np.int32)
    a.fill_bitmask(row, ())
    assert allowed_of(row, 10) == {3}
    b.fill_bitmask(row, ())
    assert allowed_of(row, 10) == {4, 0}
    c = b.fork()
    c.accept_token(4)
    assert (b.key, c.key) == ("5_2", "5_2_4")
    c.fill_bitmask(row, ())
    assert allowed_of(row, 10) == {0}  # no key for 5_2_4: only the end token
    assert not c.in_tree and not c.finished
    c.accept_token(0)
    c.accept_token(9)  # nothing moves a finished sequence
    assert c.finished and c.key == "5_2_4_0"
    c.fill_bitmask(row, ())
    assert allowed_of(row, 10) == {0}
    assert b.in_tree
    b.accept_token(9)  # leaves the tree
    assert not b.in_tree and not b.finished
    b.fill_bitmask(row, ())
    assert allowed_of(row, 10) == {0}


def test_a_row_of_the_wrong_width_is_refused() -> None:
    config = TreeDecodeConfig.from_dict({"start_token_id": 1, "end_token_id": 0, "prefix_dict": {}}, 100)
    with pytest.raises(ValueError, match="vocab_size=100"):
        TreeDecodeSource(config).fill_bitmask(np.empty(3, np.int32), ())


# ---- drafts -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_mask_bytes", [0, 1 << 30])
def test_draft_paths_give_the_masks_of_committing_on_a_copy(max_mask_bytes) -> None:
    rng = np.random.default_rng(5)
    data = random_tree(rng, V, start=3, end=0)
    config = TreeDecodeConfig.from_dict(data, V, max_mask_bytes=max_mask_bytes)
    tree_tokens = sorted({int(p) for key in data["prefix_dict"] for p in key.split("_")[1:]})
    row, expected = np.empty(config.bitmask_words, np.int32), np.empty(config.bitmask_words, np.int32)
    for trial in range(200):
        source = TreeDecodeSource(config)
        committed: list[int] = []
        for _ in range(int(rng.integers(0, 4))):
            options = sorted(ref_allowed(data, committed))
            t = int(rng.choice(options)) if rng.random() < 0.85 else int(rng.integers(V))
            source.accept_token(t)
            committed.append(t)
        draft = [int(rng.choice(tree_tokens)) if rng.random() < 0.7 else int(rng.integers(V))
                 for _ in range(int(rng.integers(0, 5)))]
        if trial % 5 == 0:  # follow the tree so that drafts reach deep nodes
            draft = []
            for _ in range(4):
                draft.append(int(rng.choice(sorted(ref_allowed(data, committed + draft)))))
        key_before = source.key
        assert source.fill_bitmask(row, draft)
        assert source.key == key_before  # unchanged by the draft
        other = copy.deepcopy(source)
        for t in draft:
            other.accept_token(t)
        assert other.fill_bitmask(expected, ())
        np.testing.assert_array_equal(row, expected)
        assert allowed_of(row, V) == ref_allowed(data, committed + draft)


def test_draft_trees_through_the_processor_mask_each_row_by_its_path(proc) -> None:
    data = {"start_token_id": 9, "end_token_id": 2, "prefix_dict": {
        "9": [10, 11, 12], "9_10": [20, 21], "9_10_20": [30, 2], "9_11": [40], "9_10_21": [999]}}
    config = TreeDecodeConfig.from_dict(data, V)
    state = RequestState([1, 9], GenerationConfig(), mask_sources=[TreeDecodeSource(config)])
    state.append_token(10)
    tree = DraftTree((20, 21, 30, 999, 5), (-1, -1, 0, 1, 0))
    other = RequestState([1, 9], GenerationConfig(), mask_sources=[TreeDecodeSource(config)])
    logits = np.random.default_rng(0).standard_normal((1 + len(tree.token_ids) + 1, V)).astype(np.float32)
    proc.inplace_update_logits(logits, [state, other], draft_trees=[tree, None])
    paths = [[]] + [tree.path(n) for n in range(len(tree.token_ids))]
    for r, path in enumerate(paths):
        assert set(np.flatnonzero(np.isfinite(logits[r])).tolist()) == ref_allowed(data, [10, *path]), path
    assert set(np.flatnonzero(np.isfinite(logits[-1])).tolist()) == {10, 11, 12}
    assert state.output_token_ids == [10] and state.mask_sources[0].key == "9_10"


# ---- malformed files --------------------------------------------------------------------------------------------

GOOD = {"start_token_id": 225, "end_token_id": 2, "sep": "_", "prefix_dict": {"225": [5, 6], "225_5": [7, 2]}}


def with_(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(GOOD)
    for name, value in changes.items():
        if value is _DROP:
            del data[name]
        else:
            data[name] = value
    return data


_DROP = object()

MALFORMED = [
    ("{", r"not valid JSON"),
    ('{"start_token_id": 225, "start_token_id": 1, "end_token_id": 2, "prefix_dict": {}}',
     r"'start_token_id' appears more than once"),
    ('{"start_token_id": 225, "end_token_id": 2, "prefix_dict": {"225": [1], "225": [3]}}',
     r"key '225' appears more than once"),
    ([1, 2], r"top level must be a JSON object"),
    (with_(start_token_id=_DROP), r"missing field 'start_token_id'"),
    (with_(end_token_id=_DROP), r"missing field 'end_token_id'"),
    (with_(prefix_dict=_DROP), r"missing field 'prefix_dict'"),
    (with_(start_token_id="225"), r"'start_token_id' must be an integer token id, got '225'"),
    (with_(end_token_id=True), r"'end_token_id' must be an integer token id, got True"),
    (with_(end_token_id=2.0), r"'end_token_id' must be an integer token id, got 2.0"),
    (with_(start_token_id=1000), r"'start_token_id' = 1000 is outside the vocabulary \[0, 1000\)"),
    (with_(end_token_id=-1), r"'end_token_id' = -1 is outside the vocabulary"),
    (with_(sep=1), r"'sep' must be a non-empty string"),
    (with_(sep=""), r"'sep' must be a non-empty string"),
    (with_(sep="_1"), r"'sep' must be a non-empty string without digits"),
    (with_(prefix_dict=[["225", [1]]]), r"'prefix_dict' must be a JSON object"),
    (with_(prefix_dict={"226_5": [1]}), r"key '226_5' does not start with the start token '225'"),
    (with_(prefix_dict={"2255": [1]}), r"key '2255' does not start with the start token '225' followed by"),
    (with_(prefix_dict={"225-5": [1]}), r"key '225-5' does not start with the start token"),
    (with_(prefix_dict={"225_a": [1]}), r"key '225_a': part 1 \('a'\) is not a token id"),
    (with_(prefix_dict={"225_5_": [1]}), r"key '225_5_': part 2 \(''\) is not a token id"),
    (with_(prefix_dict={"225__5": [1]}), r"key '225__5': part 1 \(''\) is not a token id"),
    (with_(prefix_dict={"225_-5": [1]}), r"key '225_-5': part 1 \('-5'\) is not a token id"),
    (with_(prefix_dict={"225_05": [1]}), r"key '225_05': part 1 \('05'\) is not a token id"),
    (with_(prefix_dict={"225_5.0": [1]}), r"key '225_5.0': part 1 \('5.0'\) is not a token id"),
    (with_(prefix_dict={"225_٣": [1]}), r"key '225_٣': part 1 \('٣'\) is not a token id"),
    (with_(prefix_dict={"225_1000": [1]}), r"key '225_1000': token id 1000 is outside the vocabulary"),
    (with_(prefix_dict={"225_2_5": [1]}), r"key '225_2_5' continues after end_token_id 2"),
    (with_(prefix_dict={"225_5": 7}), r"prefix_dict\['225_5'\] must be a list of token ids, got int 7"),
    (with_(prefix_dict={"225_5": {"7": 1}}), r"prefix_dict\['225_5'\] must be a list of token ids, got dict"),
    (with_(prefix_dict={"225_5": [7, "8"]}), r"prefix_dict\['225_5'\]\[1\] must be an integer token id, got '8'"),
    (with_(prefix_dict={"225_5": [7.5]}), r"prefix_dict\['225_5'\]\[0\] must be an integer token id, got 7.5"),
    (with_(prefix_dict={"225_5": [False]}), r"prefix_dict\['225_5'\]\[0\] must be an integer token id, got False"),
    (with_(prefix_dict={"225_5": [None]}), r"prefix_dict\['225_5'\]\[0\] must be an integer token id, got None"),
    (with_(prefix_dict={"225_5": [[7]]}), r"prefix_dict\['225_5'\]\[0\] must be an integer token id, got \[7\]"),
    (with_(prefix_dict={"225_5": [7, 1000]}), r"prefix_dict\['225_5'\]\[1\] = 1000 is outside the vocabulary"),
    (with_(prefix_dict={"225_5": [-3]}), r"prefix_dict\['225_5'\]\[0\] = -3 is outside the vocabulary"),
]


@pytest.mark.parametrize("data, message", MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_files_raise_a_clear_error(tmp_path, data, message) -> None:
    path = write(tmp_path, data)
    with pytest.raises(TreeDecodeConfigError, match=message) as info:
        TreeDecodeConfig.load(path, V)
    assert str(path) in str(info.value)


def test_unreadable_and_bad_vocab_size(tmp_path) -> None:
    path = tmp_path / "tree.json"
    path.write_bytes(b'{"start_token_id": \xff}')
    with pytest.raises(TreeDecodeConfigError, match="cannot read it"):
        TreeDecodeConfig.load(path, V)
    with pytest.raises(TreeDecodeConfigError, match="vocab_size must be an int >= 1"):
        TreeDecodeConfig.load(write(tmp_path, GOOD), 0)
    with pytest.raises(TreeDecodeConfigError, match="no such file"):
        TreeDecodeConfig.load(tmp_path / "missing.json", V)


def test_defaults_empty_lists_and_unknown_fields(tmp_path, caplog) -> None:
    data = {"start_token_id": 4, "end_token_id": 1, "prefix_dict": {"4": [8, 9], "4_8": []}, "weight_dict": {}}
    with caplog.at_level(logging.WARNING, logger="logitproc.tree_decode"):
        config = TreeDecodeConfig.load(write(tmp_path, data), 16)
    assert config.sep == "_" and "weight_dict" in caplog.text
    assert config.allowed_tokens([8]).tolist() == [1]  # an empty list behaves like a missing key
    assert config.allowed_tokens([]).tolist() == [8, 9]
    assert config.num_distinct_masks == 2  # {1} shared by the fallback and the empty list


# ---- paths, precedence, logging ---------------------------------------------------------------------------------

@pytest.fixture()
def model_dir(tmp_path) -> Path:
    model = tmp_path / "model"
    write(model, GOOD, "tree.json")
    write(model, GOOD, "sub/other.json")
    write(tmp_path, GOOD, "outside.json")
    os.symlink(tmp_path / "outside.json", model / "link_out.json")
    os.symlink(model / "tree.json", model / "link_in.json")
    os.symlink(tmp_path, model / "dir_out")
    return model


@pytest.mark.parametrize("value", ["../outside.json", "sub/../../outside.json", "link_out.json",
                                   "dir_out/outside.json", "ABS_OUTSIDE", "/etc/passwd", "../model/../outside.json"])
def test_environment_paths_that_leave_the_model_directory_are_refused(model_dir, value) -> None:
    if value == "ABS_OUTSIDE":
        value = str(model_dir.parent / "outside.json")
    with pytest.raises(TreeDecodeConfigError, match="outside the model directory"):
        TreeDecodeConfig.load(value, V, model_dir=model_dir)
    with pytest.raises(TreeDecodeConfigError, match=f"{ENV_VAR}: .*outside the model directory"):
        resolve_tree_decode_config(None, {ENV_VAR: value}, model_dir)


@pytest.mark.parametrize("value, name", [("tree.json", "tree.json"), ("sub/other.json", "other.json"),
                                         ("sub/../tree.json", "tree.json"), ("link_in.json", "tree.json"),
                                         ("ABS_INSIDE", "tree.json")])
def test_environment_paths_inside_the_model_directory_resolve(model_dir, value, name) -> None:
    if value == "ABS_INSIDE":
        value = str(model_dir / "tree.json")
    path = resolve_tree_decode_config(None, {ENV_VAR: value}, model_dir)
    assert path is not None and path.name == name and path.is_relative_to(model_dir.resolve())


def test_the_command_line_path_is_the_users_own(model_dir, tmp_path, monkeypatch) -> None:
    """Absolute, or relative to the working directory; anywhere, the model directory plays no part."""
    outside = (tmp_path / "outside.json").resolve()
    assert resolve_tree_decode_config(str(outside), {}, model_dir) == outside
    monkeypatch.chdir(tmp_path)
    assert resolve_tree_decode_config("outside.json", {}, model_dir) == outside
    assert resolve_tree_decode_config("model/../outside.json", {}, model_dir) == outside
    assert resolve_tree_decode_config("model/link_out.json", {}, model_dir) == outside
    assert load_tree_decode_config("outside.json", V, {}, model_dir).num_prefixes == 2
    with pytest.raises(TreeDecodeConfigError, match="--tree-decode-config: .*'tree.json': no such file"):
        resolve_tree_decode_config("tree.json", {}, model_dir)  # not looked for in the model directory


def test_missing_files_and_directories(model_dir, tmp_path) -> None:
    with pytest.raises(TreeDecodeConfigError, match=f"{ENV_VAR}: .*no such file in the model directory"):
        resolve_tree_decode_config(None, {ENV_VAR: "nope.json"}, model_dir)
    with pytest.raises(TreeDecodeConfigError, match="--tree-decode-config: .*no such file"):
        resolve_tree_decode_config(str(model_dir / "nope.json"), {}, model_dir)
    with pytest.raises(TreeDecodeConfigError, match="model directory .* does not exist"):
        resolve_tree_decode_config(None, {ENV_VAR: "tree.json"}, tmp_path / "no_model")


def test_the_cli_value_wins_over_the_environment(model_dir, monkeypatch) -> None:
    env = {ENV_VAR: "sub/other.json"}
    monkeypatch.chdir(model_dir)
    assert resolve_tree_decode_config("tree.json", env, model_dir).name == "tree.json"
    assert resolve_tree_decode_config(None, env, model_dir).name == "other.json"
    assert resolve_tree_decode_config("", env, model_dir).name == "other.json"  # an empty flag counts as unset
    assert resolve_tree_decode_config(None, {}, model_dir) is None
    assert resolve_tree_decode_config(None, {ENV_VAR: ""}, model_dir) is None
    assert load_tree_decode_config(None, V, {}, model_dir) is None
    # a broken environment value does not matter when the flag is given
    assert resolve_tree_decode_config("tree.json", {ENV_VAR: "../outside.json"}, model_dir).name == "tree.json"


def test_the_process_environment_is_the_default(model_dir, monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, "sub/other.json")
    assert resolve_tree_decode_config(None, model_dir=model_dir).name == "other.json"
    monkeypatch.delenv(ENV_VAR)
    assert resolve_tree_decode_config(None, model_dir=model_dir) is None


def test_the_load_is_logged_with_path_prefixes_and_tokens(model_dir, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="logitproc.tree_decode"):
        config = load_tree_decode_config(None, V, {ENV_VAR: "tree.json"}, model_dir)
    assert config is not None and (config.num_prefixes, config.num_candidate_tokens) == (2, 4)
    records = [r for r in caplog.records if r.name == "logitproc.tree_decode"]
    assert len(records) == 1
    message = records[0].getMessage()
    assert str((model_dir / "tree.json").resolve()) in message
    assert "2 prefixes" in message and "4 candidate tokens" in message and "dense" in message


def test_without_a_model_directory_the_path_is_taken_as_given(tmp_path, monkeypatch) -> None:
    write(tmp_path, GOOD, "plain.json")
    monkeypatch.chdir(tmp_path)
    assert TreeDecodeConfig.load("plain.json", V).num_prefixes == 2
    assert resolve_tree_decode_config(str(tmp_path / "plain.json"), {}) == (tmp_path / "plain.json").resolve()
