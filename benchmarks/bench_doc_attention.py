"""Attention time with document masking versus plain causal attention (forward + backward).

    OMP_NUM_THREADS=1 python benchmarks/bench_doc_attention.py [--seq 4096 --doc-len 200 --heads 8 --groups 8 --head-dim 64]

Packs documents of about --doc-len tokens (uniform in [doc_len/2, 3*doc_len/2]) into one sample of --seq
tokens and times, best of --iters after a warm-up:
  causal      scaled_dot_product_attention(is_causal=True): the cost without document masking
  documents   DocumentMask.attend (the training path): on CPU a dense boolean mask with SDPA, on CUDA a
              FlexAttention block mask (built once per micro-batch, not timed; blocks across documents skipped)
  per-doc     causal attention document by document: the work a variable-length kernel does, for scale
Prints milliseconds and the fraction of the causal s^2/2 score entries the documents actually need.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from megand.core.transformer.documents import DocumentMask


def doc_ids(seq: int, doc_len: int, gen) -> torch.Tensor:
    lengths, total = [], 0
    while total < seq:
        n = int(torch.randint(doc_len // 2, doc_len * 3 // 2 + 1, (1,), generator=gen))
        lengths.append(min(n, seq - total))
        total += lengths[-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None], lengths


def timed(fn, iters, device):
    best = float("inf")
    for i in range(iters + 1):  # the first call warms up (and compiles on CUDA)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--doc-len", type=int, default=200)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    ids, lengths = doc_ids(args.seq, args.doc_len, gen)
    ids = ids.to(device)
    q = torch.randn(1, args.heads, args.seq, args.head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, args.groups, args.seq, args.head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    gqa = args.groups != args.heads
    mask = DocumentMask(ids)

    def causal():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).backward(dout)

    def documents():
        mask.attend(q, k, v).backward(dout)

    def per_doc():
        outs, start = [], 0
        for n in lengths:
            s = slice(start, start + n)
            outs.append(F.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], is_causal=True,
                                                       enable_gqa=gqa))
            start += n
        torch.cat(outs, dim=2).backward(dout)

    needed = sum(n * (n + 1) / 2 for n in lengths) / (args.seq * (args.seq + 1) / 2)
    print(f"{device.type} {args.dtype}: seq {args.seq}, {len(lengths)} documents (mean {args.seq / len(lengths):.0f} "
          f"tokens), heads {args.heads}/{args.groups}, head_dim {args.head_dim}; documents need {needed:.1%} of the "
          f"causal score entries")
    for name, fn in (("causal", causal), ("documents", documents), ("per-doc", per_doc)):
        print(f"  {name:<10} fwd+bwd {timed(fn, args.iters, device):8.1f} ms", flush=True)


if __name__ == "__main__":
    main()
