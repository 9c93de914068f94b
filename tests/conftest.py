"""Shared fixtures: the devices this machine has, each with its kernels loaded, and why the others are missing; the
tiny model and SmolLM2 in the private cache; and, for a run of the whole suite, its builds in the background."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping

import pytest
from logitproc import cpu_threads, torch_guard

# Everything a run writes lives in one private folder of the system's temporary directory, removed when the run ends
# (kept, and named, when it fails: its server logs and screenshots are the diagnosis): the build cache (never the
# user's, whatever $LOGITPROC_CACHE says) and the temporary files of the tests and their subprocesses (pytest's
# tmp_path, the cache locks). ``$LOGITPROC_TEST_CACHE`` names a build cache to reuse between runs instead (every build
# is keyed by its sources, so reuse is safe).
# A run on several processes (pytest-xdist's ``-n``) is one run: its workers, started by the controlling process after
# this module, find the controller's folder in ``$LOGITPROC_TEST_RUN_FOLDER`` and share it (one build cache, one
# folder of cache locks); the controller removes it.
RUN_FOLDER_VARIABLE = "LOGITPROC_TEST_RUN_FOLDER"
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER and os.environ.get(RUN_FOLDER_VARIABLE):
    RUN_FOLDER = os.environ[RUN_FOLDER_VARIABLE]
else:
    RUN_FOLDER = os.environ[RUN_FOLDER_VARIABLE] = tempfile.mkdtemp(prefix="logitproc-test-run-")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the logitproc command sets it, and:
torch_guard.install()  # TVM imported without torch (seconds saved in each test process)
_threads = cpu_threads.configure()  # TVM's pool one thread per physical core, whatever a test runs first
if XDIST_WORKER:  # the run's threads shared among its workers: pools of all the cores each would fight over them
    os.environ["TVM_NUM_THREADS"] = str(max(1, _threads // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    # and so do torch's and numpy's BLAS pools (both read it when first imported, after this): with a pool of every
    # core in each worker, the transformers integration's tests took 103 s on two processes instead of 16 on one
    os.environ["OMP_NUM_THREADS"] = os.environ["TVM_NUM_THREADS"]
os.environ["TMPDIR"] = tempfile.tempdir = os.path.join(RUN_FOLDER, "tmp")
os.makedirs(tempfile.tempdir, exist_ok=True)
os.environ["LOGITPROC_CACHE"] = os.environ.get("LOGITPROC_TEST_CACHE") or os.path.join(RUN_FOLDER, "cache")
os.makedirs(os.environ["LOGITPROC_CACHE"], exist_ok=True)

MATRIX_DEVICES = ("cpu", "vulkan", "cuda")
_unavailable: dict[str, str] = {}
#: where the workers of a run on several processes record the devices they could not open (in the run's folder)
UNAVAILABLE_DEVICES = "unavailable-devices.jsonl"
#: A session that selects tests of at least this many test modules (the whole suite or most of it, with or without
#: ``-m``/``-k``) compiles in the background the builds its selected tests ask for (``prebuild.py``'s ``BUILDS``, each
#: with the tests that want it; none at all when none of them is selected); ``LOGITPROC_TEST_PREBUILD=1`` / ``0``
#: forces it on (for the selected tests' builds) / off. On several processes, the first worker starts it; its process
#: id is in ``PREBUILD_PID`` (in the run's folder) while it runs.
PREBUILD_MIN_MODULES = 20
PREBUILD_PID = "prebuild.pid"
_prebuild: subprocess.Popen | None = None


def pytest_collection_finish(session) -> None:
    """Start ``prebuild.py`` with the builds the selected tests ask for (its log: ``prebuild.log`` in the run's
    folder)."""
    global _prebuild
    wanted = os.environ.get("LOGITPROC_TEST_PREBUILD")
    modules = {item.path for item in session.items}
    if wanted == "0" or (wanted != "1" and len(modules) < PREBUILD_MIN_MODULES) or session.config.option.collectonly:
        return
    if XDIST_WORKER not in (None, "gw0"):
        return
    from prebuild import wanted_builds

    builds = wanted_builds((item.nodeid, item.fixturenames) for item in session.items)
    if not builds:
        return
    log = open(os.path.join(RUN_FOLDER, "prebuild.log"), "w")  # noqa: SIM115 (the child's)
    _prebuild = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "prebuild.py"), *builds],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                 start_new_session=True)
    log.close()
    with open(os.path.join(RUN_FOLDER, PREBUILD_PID), "w") as out:
        out.write(str(_prebuild.pid))


def _prebuild_running() -> bool:
    """Whether this run's background builds (started by this process or by another worker of the run) still run."""
    if _prebuild is not None:
        return _prebuild.poll() is None
    try:
        with open(os.path.join(RUN_FOLDER, PREBUILD_PID)) as pid_file:
            pid = int(pid_file.read())
    except FileNotFoundError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # an exited child its worker has not reaped yet
    except FileNotFoundError:
        return False


def pytest_sessionfinish(session, exitstatus) -> None:
    """The background builds end with the session; so does the run's private folder, unless a test failed."""
    if _prebuild is not None and _prebuild.poll() is None:
        os.killpg(_prebuild.pid, signal.SIGTERM)  # its group: a build it runs as a command ends with it
        _prebuild.wait(timeout=30)
    if XDIST_WORKER is not None:
        return
    with contextlib.suppress(FileNotFoundError), open(os.path.join(RUN_FOLDER, UNAVAILABLE_DEVICES)) as recorded:
        _unavailable.update(json.loads(line) for line in recorded)  # the workers' (``device_kernels``)
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        shutil.rmtree(RUN_FOLDER, ignore_errors=True)


#: The tests left out of the quick set (``pytest -m "not slow"``: docs/testing.md): node-id patterns (``fnmatch``) ->
#: why, and the faster tests of the quick set that check the same property, where one does. Each is long on this
#: 2-core machine (seconds measured with a warm build cache in brackets); the full suite runs them all. Marks written
#: in a test file (``@pytest.mark.slow``) count too. A pattern that matches no test of a file collected in full is an
#: error (a renamed test must not drop out of this table unnoticed).
SLOW_TESTS: dict[str, str] = {
    "tests/test_build_options.py::test_kernel_built_with_the_pass_gives_the_same_bits[[]renormalize_probs[]]":
        "[7: built again with TVM's default passes] the same check on top_n (this file)",
    "tests/test_build_options.py::test_kernel_built_with_the_pass_gives_the_same_bits[[]softmax_with_temperature[]]":
        "[4] the same check on top_n (this file)",
    # models compiled for one comparison with transformers or llama.cpp (a build or a 10k-token reference each)
    "tests/test_context_and_windows.py::test_longrope_long_context_compiled_matches_transformers":
        "[42] Phi-3's LongRoPE compiled: test_model_families' phi3 GGUF build (LongRoPE 128 in 512) and the numpy "
        "long-context test here",
    "tests/test_context_and_windows.py::test_mistral_window_compiled_matches_transformers":
        "[27] a window on every layer compiled: test_model_families' gemma2 GGUF build (a window that bites) and the "
        "numpy Mistral test here",
    "tests/test_gemma3_multimodal.py::test_compiled_text_model_matches_transformers_over_greedy_decoding":
        "[30] test_model_families' gemma3 GGUF build and the numpy text-model test here",
    "tests/test_quant_models.py::test_tiny_file_matches_numpy_and_llama_cpp*":
        "[37-41 each] every type's kernel against gguf-py and numpy (test_quant_matvec, test_packed_matvec) and "
        "llama.cpp's reading of the families' Q8_0/Q4_K_M files (test_family_quant_files)",
    "tests/test_quant_models.py::test_activation_bits_8_from_the_command_line_follows_its_reference":
        "[22] the 8-bit codes against numpy in test_packed_matvec and test_integer_matvec",
    # the same pipeline on Vulkan, which lavapipe emulates on the CPU here
    "tests/test_fused_sampling.py::test_on_vulkan_the_fused_path_gives_the_staged_tokens":
        "[36] the fused path against the staged one on the CPU (this file) and each kernel on Vulkan "
        "(test_device_matrix)",
    "tests/test_runtime.py::test_incremental_penalties_on_vulkan_match_the_cpu":
        "[19] incremental penalties on the CPU (this file) and the penalty kernels on Vulkan (test_device_matrix)",
    "tests/test_device_matrix.py::test_kernel_on_device*-vulkan]":
        "[18 to open the device, then 0.1-1 each] every kernel on the CPU against the same references (the same "
        "cases, ``-cpu``)",
    "tests/test_device.py::*vulkan]": "[1-2] the same ordering on the CPU",
    "tests/test_kernel_*.py::test_*vulkan*": "[26 to open the device, then 0.1-1 each] the same kernels on the CPU "
        "against the same references (these files)",
    "tests/test_kernel_*.py::test_*lavapipe*": "[33-43 for the first, which opens the device, then 0.1-1 each] the "
        "same kernels on the CPU against the same references (these files); the GPU variants' sources in test_library",
    # Ray Serve: a local Ray instance and replica processes per module (15 s to start, 6 s to stop)
    "tests/test_ray_serve.py::*": "[~70] Ray's parts without Ray (test_ray_options, test_ray_metrics, "
        "test_ray_proxy_guard) and the single-process server they must equal (test_server, test_hostile_http)",
    "tests/test_ray_hostile_http.py::*": "[~55] as test_ray_serve; the hostile clients against the single-process "
        "server (test_hostile_http)",
    "tests/test_ray_single_replica.py::*": "[~25] as test_ray_serve",
    # SmolLM2 (135M): the tiny model's versions of these tests are in the quick set
    "tests/test_compiled_model.py::test_smollm2_logits_match_numpy": "[4] the tiny model's builds against numpy",
    "tests/test_compiled_model.py::test_smollm2_decode_logits_match_numpy": "[6] as above",
    "tests/test_server.py::test_smollm2_answers_through_the_server": "[3] the tiny model through the server",
    "tests/test_speculative_engine.py::test_smollm2_greedy_answers_are_the_same_with_drafts":
        "[3] greedy equality with drafts on the tiny model (this file)",
    "tests/test_chat_tokens.py::test_forged_turns_stay_text*smollm2*": "[4] the same forgeries on the other templates",
    "tests/test_chat_tokens.py::test_same_control_tokens_as_transformers_sanitize_control_tokens*smollm2*":
        "[3-8 to read SmolLM2's GGUF vocabulary] the same comparison on the tiny model's ChatML vocabulary ([tiny])",
    "tests/test_chat_tokens.py::test_benign_chats_tokenize_exactly_as_the_prompt_text*smollm2*":
        "[as above] the same chats on the tiny model ([tiny])",
    "tests/test_chat_repl.py::*smollm2*": "[2-4] the REPL and generate on the tiny model",
    "tests/test_model_files.py::test_weights_are_float32_in_the_canonical_layout":
        "[10 to dequantise SmolLM2's weights; the quick tests read the file without them] the families' numpy "
        "references against transformers (test_model_families: a weight in the wrong layout fails them) and this "
        "file's tensor types",
    "tests/test_model_files.py::test_greedy_answer_names_paris":
        "[12, its weights' 10 besides] Paris from SmolLM2 compiled (test_compiled_model, test_kv_q8), whose logits "
        "the numpy reference checks in the full suite (test_compiled_model's smollm2 tests)",
    "tests/test_model_files.py::test_prefill_equals_prefill_plus_decode":
        "[25] test_prefill_equals_prefill_plus_decode_on_the_tiny_model (this file)",
    # a process of its own per check (interpreter, TVM and a model loaded each time: 1.5-8 s)
    "tests/test_cli.py::test_a_model_compile_prints_progress_and_no_engine_warning":
        "[42 on a warm cache: a fresh build; on a cold one the session's own build is checked] test_progress_line",
    "tests/test_cli.py::test_the_command_imports_tvm_without_torch_and_torch_still_imports_after":
        "[8] test_cpu_threads' import test (nothing installed on import)",
    "tests/test_cli.py::test_speculative_option_reports_its_figures_and_refuses_bad_values":
        "[5] the speculative engine's tests and test_cli's other option checks",
    "tests/test_cli.py::test_tree_decode_file_given_on_the_command_line": "[4] test_tree_decode",
    "tests/test_cli.py::test_a_schema_read_from_standard_input_or_a_pipe_constrains_the_answer":
        "[3] test_chat_repl's schema arguments (inline, file, pipe, stdin) parsed without a process",
    "tests/test_cli.py::test_ctrl_c_*": "[1.3-1.7 each] test_chat_repl's Ctrl-C tests",
    "tests/test_cli.py::test_a_closed_pipe_exits_quietly": "[1.4] test_hostile_cli's closed outputs",
    "tests/test_chat_repl.py::test_generate_prints_only_the_answer_on_stdout":
        "[4] test_cli's answer cut by max tokens (generate's stdout and stderr)",
    "tests/test_chat_repl.py::test_ctrl_d_and_two_ctrl_c_quit": "[3] test_chat_repl_on_the_tiny_model",
    "tests/test_chat_repl.py::test_commands_without_a_value_show_it_system_and_stop":
        "[2.6] test_chat_repl_on_the_tiny_model",
    "tests/test_chat_repl.py::test_ctrl_c_neither_cuts_nor_drops_an_answer_being_written":
        "[2.5] test_ctrl_c_during_a_long_prompt_stops_it_within_a_chunk",
    "tests/test_cpu_threads.py::test_an_engine_sizes_tvms_pool_when_it_opens_its_model":
        "[3.5] test_the_command_sizes_tvms_pool_as_it_starts",
    "tests/test_hostile_http.py::test_half_sent_bodies_and_broken_chunked_framing_end_without_a_500":
        "[8] the fuzz of the HTTP layer (this file)",
    "tests/test_hostile_http.py::test_ctrl_c_with_a_client_that_never_reads_drains_then_exits_130":
        "[4] the server's drain on shutdown (test_server)",
    # the documentation's code blocks run (a process each, SmolLM2 for most)
    "tests/test_doc_snippets.py::test_python_blocks_run*": "[3-7 each] test_doc_snippets' static checks of the blocks",
    "tests/test_doc_snippets.py::test_bash_blocks_marked_run_succeed*": "[2-7 each] test_bash_blocks_are_valid",
    # big inputs: a 170 MB model's load memory, the JSON-Schema-Test-Suite, real-world schemas, a browser
    "tests/test_load_memory.py::*": "[32] no faster test: the bound needs a model whose largest tensor dwarfs the "
        "margin; not part of a quick check",
    "tests/test_grammar.py::test_suite_outputs_validate_*": "[7-15 each] test_grammar's per-schema tests on both "
        "engines",
    "tests/test_schema_coverage.py::test_real_world_schemas_compile_and_their_answers_are_checked":
        "[8] test_closing's and test_grammar's schemas",
    "tests/test_closing.py::test_every_real_world_schema_has_a_plan_from_the_start":
        "[3] the closing plans of test_closing's own schemas",
    "tests/test_web_page.py::*": "[~15] the server's API the page calls (test_server, test_server_tools); "
        "the page needs a browser",
    "tests/test_agent_framework.py::*": "[3] the tool calls through the OpenAI client (test_server_tools)",
    # the same check on a second size or architecture
    "tests/test_library.py::test_cuda_source_has_every_kernel_and_its_ptx_assembles*sm_90*":
        "[4] the same source assembled for sm_80",
    "tests/test_library.py::test_rocm_code_object_is_an_amdgpu_elf_with_every_kernel*gfx942*":
        "[0 on a warm cache, 16-19 on a cold one (130-160 before the GPU kernels' lets went to registers): a build "
        "of its own] the same check on gfx90a",
    "tests/test_library.py::test_rocm_code_object_is_an_amdgpu_elf_with_every_kernel*gfx1100*":
        "[0 on a warm cache, 16-19 on a cold one] the same check on gfx90a",
    "tests/test_kernel_multinomial.py::test_zero_probability_tokens_are_never_sampled*128001*":
        "[3] the same check on the smaller vocabularies",
    "tests/test_server_tools.py::test_llama_3_1_json_calls":
        "[10: a server of its own] Llama 3.1's syntax detected from its template and parsed however cut (this "
        "file), JSON-object calls through the server with Mistral's syntax (test_server_tools_mistral) and Hermes "
        "calls (this file)",
    "tests/test_server_tools.py::test_fifty_seeded_samples_at_temperature_one_all_parse_and_validate":
        "[3] the required and named calls (this file)",
    "tests/test_server_tools_mistral.py::test_fifty_seeded_samples_at_temperature_one_all_parse_and_validate*":
        "[1.5-3.3] the required and named calls (this file)",
    "tests/test_marker_tokens.py::test_mistral_*": "[2.5-2.7] the Hermes calls with marker tokens (this file)",
}


def _leaves_out_slow(config) -> bool:
    """Whether the run's ``-m`` expression deselects every test marked ``slow``, whatever its other marks."""
    from _pytest.mark.expression import Expression

    markexpr = config.option.markexpr
    if not markexpr:
        return False
    expression = Expression.compile(markexpr)
    return not any(expression.evaluate(lambda name, other=other, **_: name == "slow" or other)
                   for other in (False, True))


def pytest_ignore_collect(collection_path, config) -> bool | None:
    """A run that leaves ``slow`` out does not import the test files whose every test ``SLOW_TESTS`` marks slow
    (``tests/test_x.py::*``): Ray Serve, langchain and selenium cost seconds to import, for tests ``-m`` deselects."""
    if collection_path.suffix != ".py" or not _leaves_out_slow(config):
        return None
    relative = collection_path.relative_to(config.rootpath).as_posix() if collection_path.is_relative_to(
        config.rootpath) else None
    if relative and f"{relative}::*" in SLOW_TESTS:
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by mark
def pytest_collection_modifyitems(config, items) -> None:
    """Mark ``slow`` the tests ``SLOW_TESTS`` names; refuse a pattern of ``SLOW_TESTS`` or of ``prebuild.BUILDS`` that
    names no test although every file it could name was collected in full."""
    from prebuild import BUILDS

    matched: set[str] = set()
    for item in items:
        for pattern in SLOW_TESTS:
            if fnmatch.fnmatchcase(item.nodeid, pattern):
                item.add_marker(pytest.mark.slow)
                matched.add(pattern)
    # (``-k`` and ``-m`` deselect after this hook; only arguments naming tests in a file collect part of it)
    named = {(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args if "::" in arg}
    whole = {item.nodeid.split("::")[0] for item in items if item.path.resolve() not in named}
    test_files = {path.relative_to(config.rootpath).as_posix() for path in config.rootpath.glob("tests/test_*.py")}

    def checkable(pattern: str) -> bool:  # every test file the pattern could name was collected in full
        files = {path for path in test_files if fnmatch.fnmatchcase(path, pattern.split("::")[0] if "::" in pattern
                                                                    else "*")}
        return bool(files) and files <= whole

    stale = [pattern for pattern in SLOW_TESTS if pattern not in matched and checkable(pattern)]
    stale += [f"{build.name}: {pattern}" for build in BUILDS for pattern in build.tests
              if checkable(pattern) and not any(fnmatch.fnmatchcase(item.nodeid, pattern) for item in items)]
    stale += [f"COLD_SECONDS: {path}" for path in COLD_SECONDS if path not in test_files]
    if test_files <= whole:
        fixtures = {name for item in items for name in item.fixturenames}
        stale += [f"{build.name}: fixture {name}" for build in BUILDS for name in build.fixtures
                  if name not in fixtures]
    if stale:
        raise pytest.UsageError(f"conftest.SLOW_TESTS or prebuild.BUILDS name no collected test: {stale}")
    if XDIST_WORKER:  # every worker sorts its collection the same way (the controller checks they are equal)
        _longest_files_first(items)


#: The test files that take longest with a cold build cache (their builds, the data they fetch once per machine, their
#: servers), seconds on this 2-core machine, one process: measured 2026-11-28 (the quick set cold, ``--durations``)
#: plus the ``slow`` tests' builds as measured earlier (``SLOW_TESTS``, docs/testing.md), so roughly. A run on several
#: processes hands the files to its workers longest first (``pytest-xdist`` would order them by their number of tests,
#: which left files like test_quant_models, 11 tests and about 500 s, to start near the end while the other worker
#: had nothing left to do); within a file the order is kept. A file not named here comes after them.
COLD_SECONDS: dict[str, int] = {
    "tests/test_quant_models.py": 420,  # SmolLM2 re-quantised and compiled 2x, the tiny Llama in 6 types
    "tests/test_model_families.py": 250,  # a build per family from the GGUF, and from the folder (slow)
    "tests/test_quant_matvec.py": 180,
    "tests/test_decode_attention.py": 145,  # its standalone kernels
    "tests/test_chat_templates.py": 145,  # llama.cpp's templates and vocabularies out of its sdist, once per machine
    "tests/test_family_quant_files.py": 130,  # a Q4_K_M build per family (slow)
    "tests/test_context_and_windows.py": 90,
    "tests/test_ray_serve.py": 90,
    "tests/test_compiled_model.py": 80,
    "tests/test_packed_matvec.py": 80,
    "tests/test_chat_tokens.py": 70,
    "tests/test_cli.py": 70,
    "tests/test_ray_hostile_http.py": 70,
    "tests/test_library.py": 60,  # ROCm gfx942 and gfx1100 (slow), 16-19 s each cold, unless prebuild made them
    "tests/test_model_files.py": 55,
    "tests/test_kv_q8.py": 50,
    "tests/test_integer_matvec.py": 45,
    "tests/test_doc_snippets.py": 45,
    "tests/test_grammar.py": 45,
    "tests/test_fused_sampling.py": 40,  # the lavapipe test (slow): 34 s cold since the library loads once per device
    "tests/test_gemma3_multimodal.py": 35,
    "tests/test_attention_window_softcap.py": 35,
    "tests/test_tokenizers.py": 35,
    "tests/test_ray_single_replica.py": 35,
    "tests/test_load_memory.py": 32,
}


def pytest_configure(config) -> None:
    """With ``-n``, the files go to the workers in the order the workers collected them (``COLD_SECONDS``)."""
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


def _longest_files_first(items: list) -> None:
    """``items`` reordered file by file: the files of ``COLD_SECONDS`` longest first, then the others by their number
    of tests, most first (as pytest-xdist orders them); within a file the order is kept."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.nodeid.split("::")[0]] = counts.get(item.nodeid.split("::")[0], 0) + 1
    items.sort(key=lambda item: (-COLD_SECONDS.get(path := item.nodeid.split("::")[0], 0), -counts[path]))


#: ``$LOGITPROC_TEST_RECORD_SKIPS`` names a file to which a run appends the node id of each test it skips (and of each
#: test module skipped whole at import), one per line: CI's second pass, with the optional engines installed, runs
#: only those (``.ci/run``) instead of those files again in full.
RECORD_SKIPS = "LOGITPROC_TEST_RECORD_SKIPS"


def _record_skip(nodeid: str) -> None:
    path = os.environ.get(RECORD_SKIPS)
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(nodeid + "\n")


def pytest_runtest_logreport(report) -> None:
    if report.skipped:
        _record_skip(report.nodeid)


def pytest_collectreport(report) -> None:
    if report.skipped:
        _record_skip(report.nodeid)


class _Devices(Mapping):
    """kind -> (Device, kernels) for every matrix device, None where the device is missing (its reason recorded for
    the summary); each device opened at its first use, so that a run that never asks for one never starts it."""

    def __getitem__(self, kind: str):
        from kernel_harness import open_device

        if kind not in MATRIX_DEVICES:
            raise KeyError(kind)
        opened, reason = open_device(kind)
        if opened is None and kind not in _unavailable:
            _unavailable[kind] = reason
            if XDIST_WORKER is not None:  # for the controller's summary
                with open(os.path.join(RUN_FOLDER, UNAVAILABLE_DEVICES), "a", encoding="utf-8") as out:
                    out.write(json.dumps([kind, reason]) + "\n")
        return opened

    def __iter__(self) -> Iterator[str]:
        return iter(MATRIX_DEVICES)

    def __len__(self) -> int:
        return len(MATRIX_DEVICES)


@pytest.fixture(scope="session")
def device_kernels() -> _Devices:
    """kind -> (Device, kernels) for every matrix device; None where the device is missing (reason recorded)."""
    return _Devices()


@pytest.fixture(scope="session")
def lib():
    """The kernel library for this CPU (built once per session into the private cache; the kernel tests'
    ``run_cpu`` calls the same build)."""
    from kernel_harness import cpu_library

    return cpu_library()


@pytest.fixture(scope="module")
def proc(lib, request):
    """A LogitProcessor over the test module's vocabulary size ``V``."""
    from logitproc import LogitProcessor

    return LogitProcessor(lib, vocab_size=request.module.V, max_num_token=64)


@pytest.fixture(scope="module")
def sampler(lib, request):
    """A Sampler over the test module's vocabulary size ``V``."""
    from logitproc import Sampler

    return Sampler(lib, vocab_size=request.module.V, max_num_token=64)


@pytest.fixture(scope="session")
def deepseek_adapter():
    """DeepSeek-V3's tokenizer (129,280 tokens, end of sequence 1) as the grammar engines see it, made once per process
    for the grammar test files (about a second each to read and index its vocabulary; the engines' own tokenizer
    data is made once per process anyway, ``grammar.get_backend``). Not to be changed by a test."""
    import material
    from logitproc.runtime.grammar import TokenizerAdapter
    from tokenizers import Tokenizer

    return TokenizerAdapter(Tokenizer.from_file(str(material.deepseek_tokenizer_path())), 129280, [1])


@pytest.fixture(scope="session")
def tiny_model_compiled_by_cli() -> subprocess.CompletedProcess:
    """The tiny model compiled once per session by ``logitproc compile --model tiny`` in a subprocess, into the private
    cache where every later subprocess finds it; the finished process (its stderr shows a fresh build's progress,
    unless an earlier test had built the model already). In a session with background builds (``prebuild.py``),
    their run of the command, which is their first build."""
    from prebuild import CLI_COMPILE_TINY, cli_record

    while not cli_record().is_file() and _prebuild_running():
        time.sleep(0.5)  # the session's background builds run this command first
    if cli_record().is_file():
        done = subprocess.CompletedProcess(CLI_COMPILE_TINY, **json.loads(cli_record().read_text()))
    else:
        done = subprocess.run(CLI_COMPILE_TINY, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="session")
def tiny_compiled(tiny_model_compiled_by_cli):
    """The tiny model opened in this process (a cache hit after ``tiny_model_compiled_by_cli``)."""
    from logitproc.serve.cli_options import open_model

    return open_model("tiny", "cpu")


@pytest.fixture(scope="session")
def default_model_in_cache():
    """The default model ("default": SmolLM2), compiled once into the private cache so that subprocesses find it.

    With ``$LOGITPROC_TEST_MODEL_CACHE`` (a cache root that keeps the GGUF between sessions) its verified file is
    linked into the private cache instead of being downloaded again.
    """
    from logitproc.compile.model_fetch import fetch_default_model, models_dir
    from logitproc.serve.cli_options import open_model

    kept = os.environ.get("LOGITPROC_TEST_MODEL_CACHE")
    if kept:
        source = fetch_default_model(kept)
        target = models_dir() / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            try:  # a hard link keeps the inode, so the verification sidecar still matches
                os.link(source, target)
                os.link(f"{source}.verified.json", f"{target}.verified.json")
            except OSError:  # another file system: a copy, verified again (hashed) when first used
                shutil.copyfile(source, target)
    return open_model("default", "cpu")


def pytest_terminal_summary(terminalreporter, exitstatus) -> None:
    """No silent skips: say which devices the matrix could not run on, and why; name the kept folder of a failed run."""
    if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        terminalreporter.write_line(f"this run's logs, screenshots and builds are kept in {RUN_FOLDER}")
    for kind, reason in _unavailable.items():
        terminalreporter.write_line(f"device matrix: {kind} not run: {reason}")
