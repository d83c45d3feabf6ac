"""Measure the data pipeline: preprocessing throughput and peak memory, index-building time.

    python benchmarks/bench_data.py --size-mb 200 --workers 1 2 --num-samples 10000000

Generates a jsonl of about --size-mb MB (paragraphs of the pydoc topics, shuffled into documents of
a few KB) and a tokenizer in a temporary directory, preprocesses it once per worker count in a fresh
process (so peak memory is that run's own), times the GPT and blending indices for --num-samples,
then deletes everything it generated unless --keep.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np


from megand.data.blended_dataset import build_blending_indices
from megand.data.gpt_dataset import build_gpt_indices
from megand.data.preprocess import preprocess_jsonl
from megand.data.quickstart import quickstart_documents
from megand.data.spm_train import train_sentencepiece


def generate_jsonl(path: str, size_mb: float, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    paragraphs = quickstart_documents()
    target, written = int(size_mb * 1e6), 0
    with open(path, "w") as f:
        while written < target:
            picks = rng.integers(0, len(paragraphs), size=rng.integers(5, 25))
            line = json.dumps({"text": "\n\n".join(paragraphs[i] for i in picks)}) + "\n"
            f.write(line)
            written += len(line)


def child_preprocess(args) -> None:
    """Run in a fresh process: one preprocessing run, then report timing and peak RSS as JSON."""
    s = preprocess_jsonl(args.input, args.output_prefix, args.tokenizer_model, append_eod=True,
                         workers=args.workers, progress=False)
    kb = 1024  # ru_maxrss is in kilobytes on Linux
    print(json.dumps({"seconds": s.seconds, "bytes": s.bytes, "tokens": s.tokens, "documents": s.documents,
                      "main_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kb / 1e6,
                      "worker_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kb / 1e6}))


def bench_indices(num_samples: int, seq_length: int, num_docs: int) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 1500, size=num_docs).astype(np.int32)
    t = time.perf_counter()
    idx = build_gpt_indices(lengths, np.arange(num_docs), seq_length, num_samples, seed=1)
    gpt_s = time.perf_counter() - t
    print(f"GPT indices: {num_samples} samples of {seq_length + 1} tokens over {num_docs} documents "
          f"({len(idx['document_index'])} document-index entries): {gpt_s:.2f} s")
    t = time.perf_counter()
    build_blending_indices([0.5, 0.3, 0.2], num_samples)
    print(f"blending indices: {num_samples} samples over 3 datasets: {time.perf_counter() - t:.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=200)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-samples", type=int, default=10_000_000)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--num-docs", type=int, default=2_000_000)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--workdir", default=None, help="where generated files go (default: a new temp dir)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--skip-preprocess", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--input", help=argparse.SUPPRESS)
    p.add_argument("--output-prefix", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer-model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.workers = args.workers[0]
        return child_preprocess(args)

    if not args.skip_preprocess:
        work = args.workdir or tempfile.mkdtemp(prefix="bench-data-")
        os.makedirs(work, exist_ok=True)
        try:
            jsonl = os.path.join(work, "corpus.jsonl")
            t = time.perf_counter()
            generate_jsonl(jsonl, args.size_mb)
            print(f"generated {os.path.getsize(jsonl) / 1e6:.1f} MB jsonl in {time.perf_counter() - t:.1f} s")
            model = train_sentencepiece(quickstart_documents(), os.path.join(work, "tok"), args.vocab_size)
            for w in args.workers:
                out = subprocess.run([sys.executable, __file__, "--child", "--workers", str(w), "--input", jsonl,
                                      "--output-prefix", os.path.join(work, f"out{w}"), "--tokenizer-model", model],
                                     check=True, capture_output=True, text=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                print(f"preprocess workers={w}: {r['bytes'] / 1e6 / r['seconds']:.2f} MB/s, "
                      f"{r['tokens'] / r['seconds']:.0f} tokens/s, {r['documents'] / r['seconds']:.0f} docs/s "
                      f"({r['seconds']:.1f} s, {r['tokens']} tokens); peak RSS main {r['main_peak_mb']:.0f} MB, "
                      f"largest worker {r['worker_peak_mb']:.0f} MB")
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
    bench_indices(args.num_samples, args.seq_length, args.num_docs)


if __name__ == "__main__":
    main()
