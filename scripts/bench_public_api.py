"""The runtime as a library user drives it (``bench_runtime.py --public-api``): the public API on numpy arrays and torch
CPU tensors, and logitproc's processor inside Hugging Face ``generate()`` next to HF's own processors.

Steps: each call of the public API with a list of states, as the README shows it, on logits the caller allocated
(numpy's allocator: 16-byte aligned, or torch's): ``inplace_update_logits(logits, states)`` (bias, penalties, a
grammar bitmask on half the rows, filled in the calling thread: ``mask_workers=0``) then
``sample_from_logits(logits, states)`` (temperature softmax, top-p, the draw); ``one call`` is the same step as
``sample_from_logits(logits, states, processor=proc)`` (the masks read by the sampling kernel instead of written).
``memcpy`` copies the float32 [B, V] logits once. Interleaved rounds: each round calls every contender once, each
step starting from fresh logits copied in before the clock starts.

HF: ``generate()`` on a tiny random Llama with a V-token head, B sequences, 32 new tokens, sampling with top-p 0.9.
Three contenders, each timed around all of its logit stages: HF's own (RepetitionPenalty, then HF's top-p warper;
HF has no presence/frequency penalty, and no schema); ``LogitprocProcessor`` (repetition, presence and frequency
penalties and a JSON schema, its ``ConstraintFactory`` made once per model) then HF's top-p warper; and
``LogitprocSampler`` doing all of that and the draw (``generate(do_sample=False)`` takes its one finite token). HF's
own draw (softmax and multinomial, or the greedy pick) is outside the timed stages. Medians: of one call of the
stages and of ``generate()``'s time per generated token over the rounds; the share is their ratio. torch gets as
many threads as TVM.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from bench_runtime import Contender, interleaved_us, make_batch
from logitproc import GenerationConfig, LogitProcessor, RequestState, Sampler
from logitproc.runtime.response_format import ResponseFormat

HF_NEW_TOKENS = 32
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}}}
#: logitproc's processing in the HF contenders (the document closed within max_tokens, 8 under max_new_tokens)
OURS = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3,
            response_format=ResponseFormat.json_schema(SCHEMA), max_tokens=HF_NEW_TOKENS - 8)


def public_step(proc: LogitProcessor, sampler: Sampler, logits: object, states: list[RequestState]) -> object:
    """One step as the README writes it: two calls, a list of states each."""
    proc.inplace_update_logits(logits, states)
    return sampler.sample_from_logits(logits, states).token_ids


def one_call_step(proc: LogitProcessor, sampler: Sampler, logits: object, states: list[RequestState]) -> object:
    """The whole step in one call: bias, penalties, masks and sampling."""
    return sampler.sample_from_logits(logits, states, processor=proc).token_ids


def bench_public_api(args: argparse.Namespace, lib) -> None:
    import torch

    rng = np.random.default_rng(0)
    header = ["B", "V", "memcpy us", "numpy step us", "torch step us", "numpy/memcpy", "torch/memcpy",
              "one call us", "one call/memcpy", "update us", "sample us"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for vocab in args.vocab:
        # masks filled in the calling thread: the bench's masks are precomputed rows (no work to spread), and on a
        # loaded machine each handoff to a worker thread waits for the GIL (milliseconds)
        proc = LogitProcessor(lib, vocab, max(args.batch), mask_workers=0)
        sampler = Sampler(lib, vocab, max_num_token=max(args.batch))
        for batch in args.batch:
            states = make_batch(batch, vocab, 128, rng)
            base = (rng.standard_normal((batch, vocab)) * 3).astype(np.float32)
            work = np.empty_like(base)  # numpy's own allocation (not TVM's)
            tensor = torch.empty((batch, vocab), dtype=torch.float32)
            tensor_view = tensor.numpy()
            copy_dst = np.empty_like(base)

            def refill(dst: np.ndarray = work, base: np.ndarray = base) -> Callable[[], None]:
                return lambda: np.copyto(dst, base)

            contenders: dict[str, Contender] = {
                "memcpy": lambda base=base, dst=copy_dst: np.copyto(dst, base),
                "numpy": (refill(work), lambda w=work, s=states, p=proc, sm=sampler: public_step(p, sm, w, s)),
                "torch": (refill(tensor_view), lambda t=tensor, s=states, p=proc, sm=sampler: public_step(p, sm, t, s)),
                "one call": (refill(work), lambda w=work, s=states, p=proc, sm=sampler: one_call_step(p, sm, w, s)),
                "update": (refill(work), lambda w=work, s=states, p=proc: p.inplace_update_logits(w, s)),
                "sample": lambda w=work, s=states, sm=sampler: sm.sample_from_logits(w, s),
            }
            us = interleaved_us(contenders, args.repeat)
            memcpy = us["memcpy"]
            cells = [batch, vocab, f"{memcpy:.0f}", f"{us['numpy']:.0f}", f"{us['torch']:.0f}",
                     f"{us['numpy'] / memcpy:.2f}", f"{us['torch'] / memcpy:.2f}", f"{us['one call']:.0f}",
                     f"{us['one call'] / memcpy:.2f}", f"{us['update']:.0f}",
                     f"{us['sample']:.0f}"]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def bench_hf_generate(args: argparse.Namespace, lib) -> None:
    import torch
    import transformers
    from logitproc.compile.gguf_model import build_tokenizer
    from logitproc.compile.tiny_model import make_tiny_model
    from logitproc.integrations.transformers import LogitprocProcessor, LogitprocSampler
    from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TopPLogitsWarper

    class Timed(LogitsProcessor):
        """Times the calls of the processors it runs in turn (a contender's every logit stage)."""

        def __init__(self, *inner: LogitsProcessor) -> None:
            self.inner, self.calls = LogitsProcessorList(inner), []

        def __call__(self, input_ids, scores):
            start = time.perf_counter()
            out = self.inner(input_ids, scores)
            self.calls.append(time.perf_counter() - start)
            return out

    import tvm
    from logitproc.runtime.constraints import ConstraintFactory

    torch.set_num_threads(tvm.get_global_func("runtime.NumThreads")())  # torch's pool as large as TVM's
    gguf = make_tiny_model()
    tokenizer = build_tokenizer(gguf)
    eos = gguf.config.eos_id
    print("\n| B | V | logit stages (timed) | generate ms/token | stages us/step | stages' share |")
    print("|---|---|---|---|---|---|")
    for vocab in args.vocab:
        config = transformers.AutoConfig.for_model(
            "llama", vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=eos,
            bos_token_id=0, pad_token_id=0)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        constraints = ConstraintFactory(tokenizer, vocab, [eos])  # made once per model, as a user would
        for batch in args.hf_batch:
            prompts = torch.randint(3, 200, (batch, 16))
            # (name, the timed stages, generate()'s do_sample): HF's multinomial draw (or greedy pick) is untimed
            makers: dict[str, tuple[Callable[[], LogitsProcessor], bool]] = {
                "HF: RepetitionPenalty 1.1, HF top-p 0.9":
                    (lambda: Timed(RepetitionPenaltyLogitsProcessor(1.1), TopPLogitsWarper(0.9)), True),
                "LogitprocProcessor: 3 penalties + JSON schema, HF top-p 0.9":
                    (lambda v=vocab, c=constraints: Timed(
                        LogitprocProcessor(lib, GenerationConfig(**OURS), v, constraints=c), TopPLogitsWarper(0.9)),
                     True),
                "LogitprocSampler: 3 penalties + JSON schema + top-p 0.9 and the draw":
                    (lambda v=vocab, c=constraints: Timed(LogitprocSampler(
                        lib, GenerationConfig(**OURS, top_p=0.9), v, constraints=c)), False),
            }
            results: dict[str, list[tuple[float, list[float], int]]] = {name: [] for name in makers}
            for round_ in range(args.hf_repeat + 1):  # interleaved; round 0 warms up
                for name, (make, sample) in makers.items():
                    timed = make()
                    torch.manual_seed(round_)
                    start = time.perf_counter()
                    out = model.generate(prompts, max_new_tokens=HF_NEW_TOKENS, do_sample=sample,
                                         logits_processor=LogitsProcessorList([timed]))
                    total = time.perf_counter() - start
                    if round_:
                        results[name].append((total, timed.calls, out.shape[1] - prompts.shape[1]))
            for name, runs in results.items():
                step = statistics.median(r[0] / r[2] for r in runs)  # seconds per generated token, per run
                call = statistics.median(t for r in runs for t in r[1])  # one call of the stages
                print(f"| {batch} | {vocab} | {name} | {step * 1e3:.2f} | {call * 1e6:.0f} | {call / step:.1%} |",
                      flush=True)
