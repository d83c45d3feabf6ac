"""Measure the data pipeline: preprocessing throughput and peak memory, index-building time.

    python benchmarks/bench_data.py --size-mb 200 --workers 1 2 --num-samples 10000000
    python benchmarks/bench_data.py --size-mb 50 --tokenizers sentencepiece huggingface tiktoken --skip-indices
    python benchmarks/bench_data.py --size-mb 1000 --format parquet --tokenizers huggingface --workers 2
    python benchmarks/bench_data.py --stream --size-mb 200 --workers 1 2 --lanes 8 --seq-length 1024
    python benchmarks/bench_data.py --stream --size-mb 1000 --workers 0 --lanes 32 --dp 1 2 4 --steps 40

Generates a jsonl (or Parquet, --format) of about --size-mb MB of text (paragraphs of the pydoc topics,
shuffled into documents of a few KB) and tokenizers of each kind (a sentencepiece model; a byte-level BPE
tokenizer.json; a .tiktoken file of that BPE's ranks) in a temporary directory, preprocesses it once per
tokenizer and worker count in a fresh process (so peak memory is that run's own), times the GPT and
blending indices for --num-samples, then deletes everything it generated unless --keep.

``--stream`` measures data.kind=stream instead: one reader (one data-parallel rank) holding --lanes lanes
of --seq-length tokens reads batches for --seconds from the quickstart corpus (the pydoc paragraphs as
JSON lines) and from a synthetic Parquet file of --size-mb, tokenizing with a sentencepiece model in
--workers processes. It reports tokens/s (and per worker), the training step that rate sustains for a
data-parallel rank of --lanes samples, and the peak RSS of the reader and of its largest worker.

``--stream --dp 1 2 4`` measures instead what one reader reads at each data-parallel size: a global batch
of --lanes samples, the reader of data-parallel rank 0 (its --lanes / dp lanes) reads --steps batches;
it reports the bytes that reader read from storage (counted by the reader: JSON-lines chunks, gzip files,
Parquet column chunks), which fall as 1/dp, with its tokens/s and peak RSS.
"""

import argparse
import base64
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


def generate_parquet(path: str, size_mb: float, seed: int = 0, rows_per_group: int = 4096) -> None:
    """The same kind of text as ``generate_jsonl``, written a row group at a time (never all in memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    paragraphs = quickstart_documents()
    target, written = int(size_mb * 1e6), 0
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as w:
        while written < target:
            docs = ["\n\n".join(paragraphs[i] for i in rng.integers(0, len(paragraphs), size=rng.integers(5, 25)))
                    for _ in range(rows_per_group)]
            w.write_table(pa.table({"text": docs}), row_group_size=rows_per_group)
            written += sum(len(d.encode()) for d in docs)


def _byte_decoder() -> dict:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, reversed."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def train_tokenizer_files(work: str, vocab_size: int) -> dict:
    """One tokenizer file per kind, trained on the pydoc topics."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = {"sentencepiece": train_sentencepiece(quickstart_documents(), os.path.join(work, "tok"), vocab_size)}
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(quickstart_documents(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    files["huggingface"] = os.path.join(work, "tokenizer.json")
    tok.save(files["huggingface"])
    # The BPE's tokens as bytes, ranked in merge order (ids after the special token), as a .tiktoken file.
    decode = _byte_decoder()
    vocab = sorted((i, t) for t, i in tok.get_vocab(with_added_tokens=False).items() if t != "<|endoftext|>")
    files["tiktoken"] = os.path.join(work, "bpe.tiktoken")
    with open(files["tiktoken"], "w") as f:
        for rank, (_, t) in enumerate(vocab):
            f.write(f"{base64.b64encode(bytes(decode[c] for c in t)).decode()} {rank}\n")
    return files


def child_preprocess(args) -> None:
    """Run in a fresh process: one preprocessing run, then report timing and peak RSS as JSON."""
    s = preprocess_jsonl(args.input, args.output_prefix, args.tokenizer_model, append_eod=True,
                         workers=args.workers, progress=False)
    kb = 1024  # ru_maxrss is in kilobytes on Linux
    print(json.dumps({"seconds": s.seconds, "bytes": s.bytes, "tokens": s.tokens, "documents": s.documents,
                      "main_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kb / 1e6,
                      "worker_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kb / 1e6}))


def child_stream(args) -> None:
    """Run in a fresh process: read a stream for ``--seconds``, then report throughput and peak RSS as JSON."""
    from megand.data.stream import StreamSource

    per_rank = args.lanes // args.dp
    source = StreamSource({"paths": [[1.0, args.input]], "tokenizer": args.tokenizer_model, "workers": args.workers},
                          args.seq_length, args.vocab_size, seed=1234).open(args.lanes, 0, per_rank)
    source.next_samples()  # the pool's start and the first units out of the timing
    start, batches = time.perf_counter(), 0
    while (batches < args.steps - 1) if args.steps else (time.perf_counter() - start < args.seconds):
        source.next_samples()
        batches += 1
    seconds = time.perf_counter() - start
    source.close()  # joins the workers: their peak RSS is then counted
    kb = 1024
    print(json.dumps({"seconds": seconds, "batches": batches, "tokens": batches * per_rank * args.seq_length,
                      "bytes_read": source.bytes_read, "corpus_bytes": sum(u.size for u in source.sources[0]),
                      "main_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kb / 1e6,
                      "worker_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kb / 1e6}))


def bench_stream(args) -> None:
    work = args.workdir or tempfile.mkdtemp(prefix="bench-stream-")
    os.makedirs(work, exist_ok=True)
    try:
        quick = os.path.join(work, "quickstart")
        os.makedirs(quick, exist_ok=True)
        with open(os.path.join(quick, "pydoc.jsonl"), "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in quickstart_documents())
        synthetic = os.path.join(work, "synthetic")
        os.makedirs(synthetic, exist_ok=True)
        corpus = os.path.join(synthetic, "corpus.parquet")
        if not os.path.exists(corpus):  # a --workdir kept (--keep) from an earlier run is reused
            generate_parquet(corpus, args.size_mb)
        model = train_sentencepiece(quickstart_documents(), os.path.join(work, "tok"), args.vocab_size)
        runs = [(w, dp) for w in args.workers for dp in (args.dp or [1])]
        for name, path in (("quickstart jsonl", quick), (f"synthetic parquet {args.size_mb:g} MB", synthetic)):
            for w, dp in runs:
                out = subprocess.run([sys.executable, __file__, "--child-stream", "--workers", str(w), "--input", path,
                                      "--tokenizer-model", model, "--lanes", str(args.lanes), "--seq-length",
                                      str(args.seq_length), "--vocab-size", str(args.vocab_size), "--seconds",
                                      str(args.seconds), "--dp", str(dp), "--steps", str(args.steps or 0)],
                                     capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"stream {name} workers={w} failed: {out.stderr.strip().splitlines()[-1]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                rate = r["tokens"] / r["seconds"]
                per_rank = args.lanes // dp
                read = (f"dp={dp}: rank 0 read {r['bytes_read'] / 1e6:.1f} MB of {r['corpus_bytes'] / 1e6:.1f} MB in "
                        f"{r['batches'] + 1} steps; " if args.dp else "")
                print(f"stream {name} workers={w}: {read}{rate:.0f} tokens/s ({rate / max(w, 1):.0f} per worker); "
                      f"sustains a step of {r['seconds'] / r['batches'] * 1e3:.0f} ms for a data-parallel rank of "
                      f"{per_rank} x {args.seq_length} tokens; peak RSS reader {r['main_peak_mb']:.0f} MB, largest "
                      f"worker {r['worker_peak_mb']:.0f} MB", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


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
    p.add_argument("--skip-indices", action="store_true")
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    p.add_argument("--tokenizers", nargs="+", choices=["sentencepiece", "huggingface", "tiktoken"],
                   default=["sentencepiece"])
    p.add_argument("--stream", action="store_true", help="measure data.kind=stream (see above)")
    p.add_argument("--lanes", type=int, default=8, help="--stream: samples per step of the reader's dp rank")
    p.add_argument("--seconds", type=float, default=20, help="--stream: how long each reader reads")
    p.add_argument("--dp", type=int, nargs="+", default=None,
                   help="--stream: data-parallel sizes; the reader of rank 0 holds --lanes / dp lanes")
    p.add_argument("--steps", type=int, default=None, help="--stream: read this many batches (not --seconds)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-stream", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--input", help=argparse.SUPPRESS)
    p.add_argument("--output-prefix", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer-model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child or args.child_stream:
        args.workers = args.workers[0]
        args.dp = args.dp[0] if args.dp else 1
        return child_stream(args) if args.child_stream else child_preprocess(args)
    if args.stream:
        return bench_stream(args)

    if not args.skip_preprocess:
        work = args.workdir or tempfile.mkdtemp(prefix="bench-data-")
        os.makedirs(work, exist_ok=True)
        try:
            corpus = os.path.join(work, f"corpus.{args.format}")
            t = time.perf_counter()
            (generate_jsonl if args.format == "jsonl" else generate_parquet)(corpus, args.size_mb)
            print(f"generated {os.path.getsize(corpus) / 1e6:.1f} MB {args.format} in {time.perf_counter() - t:.1f} s")
            files = train_tokenizer_files(work, args.vocab_size)
            for kind in args.tokenizers:
                for w in args.workers:
                    out = subprocess.run([sys.executable, __file__, "--child", "--workers", str(w), "--input", corpus,
                                          "--output-prefix", os.path.join(work, f"out{w}"), "--tokenizer-model",
                                          files[kind]], capture_output=True, text=True)
                    if out.returncode:
                        sys.exit(f"preprocess {kind} workers={w} failed: {out.stderr.strip().splitlines()[-1]}")
                    out = out.stdout
                    r = json.loads(out.strip().splitlines()[-1])
                    print(f"preprocess {args.format} {kind} workers={w}: {r['bytes'] / 1e6 / r['seconds']:.2f} MB/s, "
                          f"{r['tokens'] / r['seconds']:.0f} tokens/s, {r['documents'] / r['seconds']:.0f} docs/s "
                          f"({r['seconds']:.1f} s, {r['bytes'] / 1e6:.0f} MB, {r['tokens']} tokens); peak RSS main "
                          f"{r['main_peak_mb']:.0f} MB, largest worker {r['worker_peak_mb']:.0f} MB", flush=True)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
    if not args.skip_indices:
        bench_indices(args.num_samples, args.seq_length, args.num_docs)


if __name__ == "__main__":
    main()
