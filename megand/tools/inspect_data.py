"""Show what a run will train on: datasets, blend, epochs, and decoded samples as a rank receives them.

    python tools/inspect_data.py data=indexed 'data.paths=[[1.0, data/corpus_text_document]]' \\
        data.tokenizer=tok.model [--samples 2] [--rank 0] [--world-size N] [--iteration 1] [any key=value]

Takes the run's own overrides (the same as pretrain_gpt.py). Prints each dataset's documents and tokens,
the blend weights, how many epochs of each train split the run's ``train.iters`` read, then the first
``--samples`` samples of global batch ``--iteration`` that global rank ``--rank`` of the layout receives
(its data-parallel slice, its context-parallel chunks), decoded, with every document boundary marked
``‖`` after the EOD token (``⋯`` between the two chunks a context-parallel rank holds), and the positions and loss mask when the data.* document flags are on.
"""

import argparse
import sys
from types import SimpleNamespace

import torch


def _layout_rank(cfg, world_size: int, rank: int):
    """The data coordinates of ``rank`` in the layout, without processes."""
    from megand.core.parallel_state import ParallelSizes, rank_coords

    p = cfg.parallel
    sizes = ParallelSizes.infer(world_size, tp=p.tp, pp=p.pp, cp=p.cp, dp=p.dp)
    c = rank_coords(rank, sizes, p.order)
    return SimpleNamespace(dp_size=sizes.dp, dp_rank=c["dp"], cp_size=sizes.cp, cp_rank=c["cp"], pp_rank=c["pp"],
                           pp_size=sizes.pp, tp_rank=c["tp"], device=torch.device("cpu"))


def _datasets_summary(cfg, train) -> list[str]:
    from megand.data.builder import parse_paths
    from megand.data.indexed_dataset import IndexedDataset
    from megand.data.source import STREAM, data_kind

    if data_kind(cfg.data.kind).access == STREAM:
        return [f"{spec}: stream of {len({u.path for u in units})} file(s), {len(units)} unit(s) (whole files, "
                f"chunks of files, Parquet row groups or Arrow record batches), mixture weight {w:.3f}"
                for spec, units, w in zip(train.specs, train.sources, train.weights)]
    if cfg.data.kind != "indexed":
        return [f"data.kind={cfg.data.kind} (blend: one dataset)"]
    lines = []
    paths = parse_paths(list(cfg.data.paths))
    total = sum(w for w, _ in paths)
    for w, prefix in paths:
        ds = IndexedDataset(prefix)
        lines.append(f"{prefix}: {len(ds)} documents, {ds.num_tokens} tokens, blend weight {w / total:.3f}")
    return lines


def _epochs(dataset) -> list[str]:
    """Epochs over each train split, from the built indices (a blend: per dataset)."""
    out = []
    for part in getattr(dataset, "datasets", None) or [dataset]:
        desc = getattr(part, "description", None)
        if desc is None:
            continue
        first, last = desc["documents"]
        out.append(f"{part.indexed.prefix} train split: documents [{first}, {last}), {len(part)} samples drawn "
                   f"from {len(part.document_index) / max(last - first, 1):.0f} epoch(s) of it "
                   f"({len(part) * part.seq_length / max(int(part.indexed.sequence_lengths[first:last].sum()), 1):.2f} "
                   f"epochs of tokens read)")
    return out


def _stream_microbatches(stream, iteration, t, topo, flags, seq_length):
    """A stream's batch ``iteration`` as rank ``topo`` receives it (read from the stream's start), and the
    ``file:row`` of the documents in each of its samples."""
    from megand.training.batches import samples_microbatches

    per_dp = t.global_batch_size // topo.dp_size
    stream.open(t.global_batch_size, topo.dp_rank * per_dp, per_dp)
    stream.workers = 0  # one batch: tokenized here
    stream.history = {}
    for _ in range(iteration + 1):
        starts = {lane.index: (lane.docs[0] if lane.docs else len(stream.history.get(lane.index, [])), lane.offset)
                  for lane in stream.mine}
        samples = stream.next_samples()
    sources = []
    for lane in stream.mine:  # the documents the sample spans: from the one it starts in, for seq_length+1 tokens
        first, offset = starts[lane.index]
        docs, covered = [], -offset
        taken = stream.history[lane.index]
        first = first if isinstance(first, int) else next(i for i, d in enumerate(taken) if d is first)
        for doc in taken[first:]:
            if covered >= seq_length + 1:
                break
            if doc.tokens is not None and len(doc.tokens):
                docs.append(doc.where)
                covered += len(doc.tokens)
        sources.append(docs)
    import torch

    return samples_microbatches(torch.from_numpy(samples), t.micro_batch_size, topo, seq_length,
                                documents=flags), sources


def _decode_marked(tok, ids, eod) -> str:
    pieces, current = [], []
    for t in ids:
        current.append(t)
        if t == eod:
            pieces.append(tok.decode(current))
            current = []
    if current:
        pieces.append(tok.decode(current))
    return " ‖ ".join(repr(p) for p in pieces)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--rank", type=int, default=0, help="global rank of the layout whose samples to show")
    p.add_argument("--world-size", type=int, default=None, help="default: tp*pp*cp (x parallel.dp when set)")
    p.add_argument("--iteration", type=int, default=1,
                   help="the iteration whose global batch to show, counted from 1 as the console line counts")
    args, overrides = p.parse_known_args(argv)
    from megand.data.builder import build_datasets, data_tokenizer
    from megand.data.errors import DataError
    from megand.data.source import STREAM, data_kind
    from megand.training.batches import microbatch_rows, rank_microbatches
    from megand.training.config import ConfigError, compose, validate
    from megand.training.core_configs import document_flags

    try:
        cfg = compose(overrides)
        pc = cfg.parallel
        world = args.world_size or pc.tp * pc.pp * pc.cp * (pc.dp or 1)
        validate(cfg, world)
        if not 0 <= args.rank < world:
            raise ConfigError(f"--rank {args.rank} is outside the world of {world} ranks")
        m, t = cfg.model, cfg.train
        if not 1 <= args.iteration <= t.iters:
            raise ConfigError(f"--iteration {args.iteration} is outside the run's iterations 1..{t.iters} "
                              f"(train.iters={t.iters}; counted from 1 as the console line counts)")
        train, _, _ = build_datasets(cfg.data, m.seq_length, m.vocab_size, t.seed,
                                     (t.iters * t.global_batch_size, 0, 0))
        tok = data_tokenizer(cfg.data, m.vocab_size)
        flags = document_flags(cfg)
    except (ConfigError, DataError, OSError) as e:
        print(f"inspect_data: {e}", file=sys.stderr)
        return 2
    for line in _datasets_summary(cfg, train) + _epochs(train):
        print(line)
    print(f"the run reads {t.iters * t.global_batch_size} samples of {m.seq_length + 1} tokens "
          f"({t.iters} iterations x global batch {t.global_batch_size})")
    topo = _layout_rank(cfg, world, args.rank)
    if data_kind(cfg.data.kind).access == STREAM:
        try:
            microbatches, sources = _stream_microbatches(train, args.iteration - 1, t, topo, flags, m.seq_length)
        except DataError as e:
            print(f"inspect_data: {e}", file=sys.stderr)
            return 2
    else:
        sources = None
        microbatches = rank_microbatches(train, args.iteration - 1, t.global_batch_size, t.micro_batch_size, topo,
                                         documents=flags)
    print(f"rank {args.rank} (dp {topo.dp_rank}/{topo.dp_size}, cp {topo.cp_rank}/{topo.cp_size}, "
          f"pp {topo.pp_rank}/{topo.pp_size}), iteration {args.iteration}:")
    shown = 0
    rows = microbatch_rows(t.global_batch_size // topo.dp_size, t.micro_batch_size)  # the samples' lanes
    for k, mb in enumerate(microbatches):
        for i in range(mb.batch_size):
            if shown >= args.samples:
                return 0
            ids = mb.input_ids[i].tolist()
            print(f"  micro-batch {k} sample {i}: {len(ids)} tokens"
                  + (" (this rank's context-parallel chunks)" if topo.cp_size > 1 else ""))
            eod = tok.eod_id if flags is None else flags.eod_id
            chunks = [ids] if topo.cp_size == 1 else [ids[: len(ids) // 2], ids[len(ids) // 2:]]
            print("    " + "  ⋯  ".join(_decode_marked(tok, c, eod) for c in chunks))
            pos = mb.positions[i] if mb.positions.dim() == 2 else mb.positions
            print(f"    positions {pos.tolist()}")
            if sources is not None:
                print(f"    documents from {', '.join(sources[rows[k][i]])}")
            if mb.loss_mask is not None:
                print(f"    loss on {int(mb.loss_mask[i].sum())} of {len(ids)} tokens")
            shown += 1
    return 0
