"""Step time of a Llama decoder block and a small Llama model under torch.compile, with and without torch_ln's
compile pass (torch_ln.compile.backend), against the same model swapped by replace_norms (issue 41).

Providers, each torch.compile(fullgraph=True) of the same randomly initialized model, the inner backend `--inner`
(default Inductor):
  compile       the model as it is: Inductor's own code for the norms and adds
  pass          torch_ln.compile.backend(): the norms and the adds before them rewritten to torch_ln's operators
  swapped       torch_ln.replace_norms(model) compiled: torch_ln's norms, Inductor's adds

Cases: `block` is a LlamaModel of one decoder layer fed embeddings (its two norms, one fused add, the final norm);
`model` a LlamaForCausalLM of --layers layers. Steps: `fwd` (inference, no_grad) and `fwd+bwd` (the forward, then
backward of a fixed gradient of the output). Timed by torch_ln's timing core (CPU: interleaved blocks of calls,
median; CUDA: events), compile time not timed but reported. The check column says whether `pass` gives the swapped
model's output bit for bit (it must, see tests/test_compile_pass.py).

    python benchmarks/bench_compile_pass.py --out bench_out                     # CPU: hidden 1024, batch 2 x 256
    python benchmarks/bench_compile_pass.py --device cuda --dtype bfloat16 --batch 8 --seq 2048 --hidden 4096
    python benchmarks/bench_compile_pass.py --quick --hidden 64 --seq 16 --inner aot_eager --out /tmp/b  # smoke
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import transformers
from harness import add_model_step_arguments, write_rows

import torch_ln
import torch_ln.compile
from torch_ln._timing import FULL, QUICK, device_name, measure

PROVIDERS = ("compile", "pass", "swapped")
CASES = ("block", "model")
STEPS = ("fwd", "fwd+bwd")


def _config(args, layers: int):
    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=args.seq,
    )


def _case(name: str, args):
    """(model, inputs): the block is fed embeddings, the model token ids."""
    torch.manual_seed(0)
    if name == "block":
        model = transformers.LlamaModel(_config(args, 1))
        inputs = {"inputs_embeds": torch.randn(args.batch, args.seq, args.hidden)}
    else:
        model = transformers.LlamaForCausalLM(_config(args, args.layers))
        inputs = {"input_ids": torch.randint(0, args.vocab, (args.batch, args.seq))}
    model = model.to(args.device, getattr(torch, args.dtype)).eval()
    with torch.no_grad():  # trained-looking norm weights
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.3 * torch.randn_like(param))
    inputs = {
        k: v.to(args.device, model.dtype) if v.is_floating_point() else v.to(args.device) for k, v in inputs.items()
    }
    return model, inputs


def _output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _compiled(provider: str, model, inner: str):
    if provider == "swapped":
        return torch.compile(torch_ln.replace_norms(copy.deepcopy(model)), backend=inner, fullgraph=True)
    backend = torch_ln.compile.backend(inner) if provider == "pass" else inner
    return torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)


def _step_fn(compiled, inputs, step: str, grad):
    if step == "fwd":

        def forward():
            with torch.no_grad():
                return _output(compiled(**inputs, use_cache=False))

        return forward

    def forward_backward():
        out = _output(compiled(**inputs, use_cache=False))
        out.backward(grad)
        return out

    return forward_backward


def run(args) -> list[dict]:
    rows = []
    timing = QUICK if args.quick else FULL
    for case in args.cases:
        model, inputs = _case(case, args)
        with torch.no_grad():
            grad = torch.randn_like(_output(model(**inputs, use_cache=False)))
        for step in args.steps:
            torch._dynamo.reset()
            fns, outputs, compile_s = {}, {}, {}
            for provider in args.providers:
                compiled = _compiled(provider, model, args.inner)
                start = time.perf_counter()
                fn = _step_fn(compiled, inputs, step, grad)
                outputs[provider] = fn().detach()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                compile_s[provider] = time.perf_counter() - start
                fns[provider] = fn
            ms = measure(fns, args.device, timing)
            for provider in args.providers:
                check = ""
                if provider == "pass" and "swapped" in outputs:
                    check = "bitwise" if torch.equal(outputs["pass"], outputs["swapped"]) else "DIFFERS"
                row = {
                    "case": case,
                    "dtype": args.dtype,
                    "step": step,
                    "provider": provider,
                    "ms": round(ms[provider], 4),
                    "vs_compile": round(ms["compile"] / ms[provider], 3) if "compile" in ms else "",
                    "compile_s": round(compile_s[provider], 1),
                    "check": check,
                }
                rows.append(row)
                print(
                    f"{case:6} {args.dtype:9} {step:8} {provider:8} {row['ms']:10.3f} ms  "
                    f"x{row['vs_compile']} vs compile  (compiled in {row['compile_s']} s) {check}",
                    flush=True,
                )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_step_arguments(parser, hidden=1024)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--inner", default="inductor", help="the backend after the pass (and for the others)")
    parser.add_argument("--out", type=Path, default=None, help="folder for compile_pass.csv")
    args = parser.parse_args(argv)
    print(f"# {device_name(args.device)}, torch {torch.__version__}, inner backend {args.inner}", flush=True)
    rows = run(args)
    if args.out is not None:
        write_rows(rows, args.out / "compile_pass.csv")
    return 1 if any(r["check"] == "DIFFERS" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
