"""The matrix products of one training step, ONNX Runtime's MLAS against PyTorch's BLAS, shape by shape.

    python benchmarks/gemm_shapes.py --model gpt2-124m                 # 1 thread, CPU time, ~1 min
    python benchmarks/gemm_shapes.py --model gpt2-124m --isa avx2      # both libraries as on an AVX2 host

Why: a training step of a real-size model is mostly GEMMs (GPT-2 124M: ~80% of ORTTrainer's kernel
time, `profile_step.py`), and which library's GEMM is faster for each shape bounds what any graph
rewrite can gain. For every linear layer of the model (forward Y = X W, input gradient dX = dY W^T,
weight gradient dW = X^T dY, with the transposes ORT's training graph uses) and the tied vocabulary
head, one ``Gemm`` node in its own ORT session is timed against ``torch.mm`` on the same arrays, in
the same process, interleaved, by the thread's CPU time (robust to other processes on a loaded
machine), median of --repeat.

ONNX Runtime's MLAS picks its kernels from CPUID at load time (AVX-512F where the CPU has it) and has
no switch to hold it to AVX2: ``--isa avx2`` (`benchmarks/_isa.py`) masks CPUID for the whole process
instead, so MLAS, MKL and ATen all take their AVX2 kernels (same cores otherwise; the stamp says so).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import host_stamp
from benchmarks._hf import SCALE_MODELS, SEQ
from benchmarks._isa import add_isa_argument, use_isa


def model_gemms(name: str, batch: int | None) -> list[tuple[str, int, int, int, int, bool]]:
    """(label, tokens, d_in, d_out, count per step, weight stored [d_out, d_in]) of a `SCALE_MODELS` entry's
    linear maps: GPT-2's ``Conv1D`` stores [d_in, d_out], ``nn.Linear`` and the tied head [d_out, d_in]."""
    family, layers, config, default_batch, _ = SCALE_MODELS[name]
    tokens = (batch or default_batch) * SEQ
    if family == "gpt2":
        d, vocab = config.get("n_embd", 256), config.get("vocab_size", 8000)
        ff = 4 * d
    else:
        d, vocab = config.get("hidden_size", 256), None
        ff = config.get("intermediate_size", 1024)
    linear = family != "gpt2"
    rows = [
        ("attention in-projection (q,k,v)", tokens, d, 3 * d, layers, linear),
        ("attention out-projection", tokens, d, d, layers, linear),
        ("MLP up", tokens, d, ff, layers, linear),
        ("MLP down", tokens, ff, d, layers, linear),
    ]
    if family != "gpt2":  # BERT's q, k, v are three d x d Linear layers, not one d x 3d Conv1D
        rows[0] = ("attention q / k / v", tokens, d, d, 3 * layers, linear)
    if vocab:
        rows.append(("vocabulary head (tied)", tokens, d, vocab, 1, True))
    return rows


def _session(node, shapes: dict) -> ort.InferenceSession:
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])


def products(tokens: int, d_in: int, d_out: int, out_in: bool) -> dict:
    """The three products of one linear map, with the transposes ORT's training graph uses:
    {name: (ORT session, feeds, torch function)}; ``out_in``: the weight is stored [d_out, d_in]."""
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((tokens, d_in), np.float32), rng.standard_normal((tokens, d_out), np.float32)
    w = rng.standard_normal((d_out, d_in) if out_in else (d_in, d_out), np.float32)
    tx, tdy, tw = map(torch.from_numpy, (x, dy, w))
    if out_in:  # Y = X W^T, dX = dY W, dW = dY^T X
        cases = {
            "forward": ((x, w), {"transB": 1}, lambda: tx.mm(tw.t())),
            "input grad": ((dy, w), {}, lambda: tdy.mm(tw)),
            "weight grad": ((dy, x), {"transA": 1}, lambda: tdy.t().mm(tx)),
        }
    else:  # Y = X W, dX = dY W^T, dW = X^T dY
        cases = {
            "forward": ((x, w), {}, lambda: tx.mm(tw)),
            "input grad": ((dy, w), {"transB": 1}, lambda: tdy.mm(tw.t())),
            "weight grad": ((x, dy), {"transA": 1}, lambda: tx.t().mm(tdy)),
        }
    out = {}
    for name, ((a, b), attrs, torch_fn) in cases.items():
        node = helper.make_node("Gemm", ["a", "b"], ["y"], **attrs)
        out[name] = (_session(node, {"a": a.shape, "b": b.shape}), {"a": a, "b": b}, torch_fn)
    return out


def cpu_ms(fn, repeat: int) -> list[float]:
    fn()
    times = []
    for _ in range(repeat):
        start = time.thread_time()
        fn()
        times.append((time.thread_time() - start) * 1e3)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-124m", choices=sorted(SCALE_MODELS))
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=5)
    add_isa_argument(parser)
    args = parser.parse_args(argv)
    use_isa(args.isa)
    torch.set_num_threads(1)
    print(host_stamp())
    print(f"\n1 thread, CPU ms per product (median of {args.repeat}, interleaved); GFLOP/s in parentheses\n")
    print("| layer | product | M x K x N | per step | ORT MLAS ms | PyTorch ms | ORT ÷ PyTorch |")
    print("|---|---|---|---|---|---|---|")
    total_ort = total_torch = 0.0
    for label, tokens, d_in, d_out, count, out_in in model_gemms(args.model, args.batch):
        gflop = 2 * tokens * d_in * d_out / 1e9
        for product, (session, feeds, torch_fn) in products(tokens, d_in, d_out, out_in).items():
            ort_times, torch_times = [], []
            for _ in range(args.repeat):  # interleaved: one of each per repetition
                ort_times += cpu_ms(lambda s=session, f=feeds: s.run(None, f), 1)
                torch_times += cpu_ms(torch_fn, 1)
            o, t = statistics.median(ort_times), statistics.median(torch_times)
            total_ort, total_torch = total_ort + o * count, total_torch + t * count
            print(
                f"| {label} | {product} | {tokens}x{d_in}x{d_out} | {count} | {o:.1f} ({gflop / o * 1e3:.0f}) | "
                f"{t:.1f} ({gflop / t * 1e3:.0f}) | {o / t:.2f} |",
                flush=True,
            )
    print(
        f"\nall GEMMs of a step: ORT {total_ort:.0f} ms, PyTorch {total_torch:.0f} ms, ORT ÷ PyTorch "
        f"{total_ort / total_torch:.2f}"
    )
    print(f"end: {host_stamp().splitlines()[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
