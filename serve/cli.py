"""The ``logitproc`` command line.

Only the standard library loads before a command runs (``logitproc --help`` is instant); TVM loads when a command
needs it. Ctrl-C ends any command quietly with status 130, a closed output pipe (``| head -1``) with 141; bad input
(an option's value, arguments that are not UTF-8, a closed stdout) is one line on stderr and status 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from ..quiet_stderr import filtered_stderr
from .cli_options import TARGET_CHOICES, add_activation_bits_argument, add_context_argument, add_kv_dtype_argument


def _compile_kernels(args: argparse.Namespace) -> int:
    from logitproc.compile import build_kernels

    started = time.perf_counter()
    print(f"building kernels for {args.target}{' ' + args.arch if args.arch else ''} ...", file=sys.stderr)
    library = build_kernels(args.target, args.arch, cache=not args.no_cache)
    out = library.export(args.out)
    print(f"{len(library.kernel_names)} kernels in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    for filename in library.manifest["files"]:
        print(out / filename)
    print(out / "manifest.json")
    return 0


def _compile_model(args: argparse.Namespace) -> int:
    from logitproc.compile.model_compile import compile_model

    from .cli_options import TINY_MODEL, tiny_model
    from .progress_line import ProgressLine

    started = time.perf_counter()
    model = tiny_model() if args.model == TINY_MODEL else args.model
    with ProgressLine(sys.stderr) as progress:
        out = compile_model(model, args.target, args.out, progress=progress, weight_dtype=args.weight_dtype,
                            kv_dtype=args.kv_dtype, context=args.context, activation_bits=args.activation_bits)
    print(f"done in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    print(out)
    return 0


def _models(args: argparse.Namespace) -> int:
    from logitproc.compile.families import FAMILIES
    from logitproc.compile.rope import SCALING_KEYS

    rows = [("family", "models", "Hugging Face architectures", "GGUF")]
    rows += [(f.name, f.models, ", ".join(f.hf_classes), ", ".join(f.gguf_architectures)) for f in FAMILIES]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print(" ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + " " + row[3])
    print(f"\nformats: a GGUF file (--model path.gguf) or a Hugging Face folder (--model path/, safetensors "
          f"F32/F16/BF16); RoPE scaling: {', '.join(SCALING_KEYS)} (and a GGUF's rope_freqs); docs/model.md")
    return 0


def _devices(args: argparse.Namespace) -> int:
    from logitproc.runtime.device import Device

    with filtered_stderr():
        found = Device.available()
    for info in found:
        print(info)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from logitproc import __version__

    parser = argparse.ArgumentParser(prog="logitproc", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=f"logitproc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    compile_kernels = commands.add_parser(
        "compile-kernels", help="build the kernel library for a target and export it with a manifest"
    )
    compile_kernels.add_argument("--target", required=True, choices=TARGET_CHOICES)
    compile_kernels.add_argument("--arch", help="CPU name, sm_NN (cuda) or gfxNNNN (rocm); default per target")
    compile_kernels.add_argument("--out", required=True, help="directory to write the library into")
    compile_kernels.add_argument("--no-cache", action="store_true", help="build afresh instead of reusing the cache")
    compile_kernels.set_defaults(run=_compile_kernels)

    compile_model = commands.add_parser(
        "compile", help="compile a model and the logit-processing kernels into one library (cached); print its folder"
    )
    compile_model.add_argument("--model", default="default",
                               help="'default' (SmolLM2-135M-Instruct), 'tiny' (random test model), a GGUF file "
                               "or a Hugging Face directory (default: %(default)s)")
    compile_model.add_argument("--target", default="cpu", choices=("cpu",), help="(default: %(default)s)")
    compile_model.add_argument("--out", help="also copy the compiled model into this directory (default: none)")
    compile_model.add_argument("--weight-dtype", default="auto", choices=("auto", "float16", "float32"),
                               help="auto: keep a GGUF's quantised blocks (types without a kernel requantised to "
                                    "Q8_0), float16 for other tensors (default: %(default)s)")
    add_kv_dtype_argument(compile_model)
    add_activation_bits_argument(compile_model)
    add_context_argument(compile_model)
    compile_model.set_defaults(run=_compile_model)

    models = commands.add_parser("models", help="list the supported model families and formats")
    models.set_defaults(run=_models)

    devices = commands.add_parser("devices", help="list the devices found: backend and limits")
    devices.set_defaults(run=_devices)

    from . import chat, generate, server_cli

    chat.add_parser(commands)
    generate.add_parser(commands)
    server_cli.add_parser(commands)
    return parser


def _quiet_broken_pipe() -> int:
    """stdout's reader has gone (``| head -1``): point stdout at /dev/null so the final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + 13  # as if killed by SIGPIPE, like other command-line tools


def _undecodable(argv: Sequence[str]) -> str | None:
    """Why an argument is not valid UTF-8 (Python keeps such bytes as lone surrogates), or None."""
    for position, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raw = os.fsencode(arg) if isinstance(arg, str) else arg
            return f"argument {position} ({raw!r}) is not valid UTF-8"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    bad = _undecodable(argv)
    if sys.stdout is None:  # started with stdout closed (``>&-``)
        bad = "standard output is closed: there is nowhere to write to"
    if bad is not None:
        print(f"logitproc: error: {bad}", file=sys.stderr)
        return 2
    command = "logitproc"
    try:
        args = build_parser().parse_args(argv)
        command = f"logitproc {args.command}"
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return status
    except (ValueError, TypeError, RuntimeError, FileNotFoundError) as err:
        print(f"{command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 128 + 2  # SIGINT: quiet, the shell's convention
    except BrokenPipeError:
        return _quiet_broken_pipe()


if __name__ == "__main__":
    sys.exit(main())
