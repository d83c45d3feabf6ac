"""The CPU kernels behind the end-to-end choices, each timed alone at ``llama_50m``'s shapes (micro-batch 4, seq
256: 1024 tokens, hidden 512, 8 heads / 4 K/V groups of 64, ffn 1408, vocab 16000), each variant the median
of ``--repeat`` calls, the variants of one row alternating. Prints one line per row, then one JSON line.

- ``logits``: the output layer's product ``[1024, 512] x [512, 16000]^T`` into a fresh tensor (run it under
  ``THP_MEM_ALLOC_ENABLE=1`` for huge pages) and into memory already mapped;
- ``attention``: flash attention forward and backward on the layer's ``[s, b, heads, d]`` views, on queries and
  keys laid out ``[b, heads, s, d]`` (values still views), all three laid out so, and the math kernel;
- ``sum_of_squares``: a 50 M-element gradient's sum of squares by 1 MiB pieces, ``pow(2).sum()`` against a dot
  product, with each one's relative error against float64;
- ``swiglu_backward``: the compiled elementwise part of the SwiGLU backward, the gate and up gradients
  interleaved (what the fused fc1 weight's rows need) against two contiguous tensors.

    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_kernels.py
    OMP_NUM_THREADS=1 THP_MEM_ALLOC_ENABLE=1 python benchmarks/bench_cpu_kernels.py --rows logits
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

TOKENS, HIDDEN, VOCAB, BATCH, SEQ, HEADS, GROUPS, HEAD_DIM, FFN = 1024, 512, 16000, 4, 256, 8, 4, 64, 1408


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def alternate(variants: dict, repeat: int, rounds: int = 3) -> dict:
    """Each variant's best median over ``rounds`` rounds, the variants alternating round by round."""
    best = {name: float("inf") for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            best[name] = min(best[name], median_ms(fn, repeat))
    return best


def logits(repeat):
    x, w = torch.randn(TOKENS, HIDDEN), torch.randn(VOCAB, HIDDEN)
    out = torch.empty(TOKENS, VOCAB)
    return alternate({"fresh": lambda: x @ w.t(), "reused": lambda: torch.mm(x, w.t(), out=out)}, repeat)


def attention(repeat):
    def seq_first(heads):  # [b, heads, s, d] views of [s, b, heads, d]
        return torch.randn(SEQ, BATCH, heads, HEAD_DIM).permute(1, 2, 0, 3)

    q, k, v, grad = seq_first(HEADS), seq_first(GROUPS), seq_first(GROUPS), seq_first(HEADS)

    def run(q, k, v, backend=SDPBackend.FLASH_ATTENTION):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    dense = [t.contiguous() for t in (q, k, v)]
    return alternate({"views": lambda: run(q, k, v), "qk_dense": lambda: run(*dense[:2], v),
                      "all_dense": lambda: run(*dense), "math_views": lambda: run(q, k, v, SDPBackend.MATH)},
                     repeat)


def sum_of_squares(repeat):
    g = torch.randn(50_000_000) * 1e-3
    pieces = g.split(1 << 18)
    exact = g.double().square().sum().item()
    ways = {"pow_sum": lambda: torch.stack([p.pow(2).sum() for p in pieces]).sum(),
            "dot": lambda: torch.stack([torch.dot(p, p) for p in pieces]).sum()}
    row = alternate(ways, max(3, repeat // 4))
    row.update({f"{name}_relative_error": abs(fn().item() - exact) / exact for name, fn in ways.items()})
    return row


def swiglu_backward(repeat):
    gate, up, grad = (torch.randn(TOKENS, FFN) for _ in range(3))

    def parts(grad, gate, up):
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)

    interleaved = torch.compile(lambda grad, gate, up: torch.stack(parts(grad, gate, up), dim=-1))
    contiguous = torch.compile(parts)
    return alternate({"interleaved": lambda: interleaved(grad, gate, up),
                      "two_contiguous": lambda: contiguous(grad, gate, up)}, repeat)


ROWS = {"logits": logits, "attention": attention, "sum_of_squares": sum_of_squares, "swiglu_backward": swiglu_backward}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="*", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--repeat", type=int, default=15, help="calls per variant and round (the median is kept)")
    args = p.parse_args()
    results = {}
    for name in args.rows:
        results[name] = ROWS[name](args.repeat)
        print(name + ": " + ", ".join(f"{k} {v:.3g}" + ("" if "error" in k else " ms")
                                       for k, v in results[name].items()), flush=True)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), **results}))


if __name__ == "__main__":
    main()
