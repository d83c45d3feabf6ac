"""How long the first forward module waits for its parameters after the optimizer step, with the
all-gathers of ``optim.overlap_param_gather`` (ZeRO-1) issued in forward order (what the engine does)
or in bucket order (the output layer's bucket first: the order before the fix).

    python benchmarks/bench_param_gather.py [--rounds 5] [--hidden 256] [--layers 8] [--bucket-size 200000]

Two gloo ranks (dp=2). Each round, for each order alternately: issue every bucket's all-gather, then
time (a) the wait for the first forward module's bucket and (b) the wait for all of them. Prints one
JSON line with the medians in ms. On gloo the collectives of a process group run one after the other
in the order issued, like NCCL's; the absolute times are this CPU's, not a GPU's.
"""

import argparse
import json
import statistics
import tempfile
import time


def _worker(hidden, layers, bucket_size, rounds):
    from megand.training.config import compose
    from megand.training.pretrain import Trainer

    cfg = compose(["+experiment=tiny_llama", f"run_dir={tempfile.mkdtemp()}", f"model.hidden_size={hidden}",
                   f"model.ffn_hidden_size={4 * hidden}", f"model.num_layers={layers}", "model.vocab_size=8000",
                   "optim.sharding=optim", "optim.overlap_param_gather=true", f"optim.bucket_size={bucket_size}"])
    t = Trainer(cfg)
    ddp = t.ddp
    t.step()
    ddp.finish_param_sync()
    forward = list(ddp.forward_order)
    orders = {"forward order": forward, "bucket order (before)": sorted(forward)}
    first = forward[0]  # the bucket the first module's forward waits for
    times = {name: {"first_wait_ms": [], "all_ms": []} for name in orders}
    for _ in range(rounds):
        for name, order in orders.items():
            ddp.forward_order = order
            torch_barrier()
            start = time.perf_counter()
            ddp.start_param_sync()
            ddp._wait_params([first])
            times[name]["first_wait_ms"].append(1e3 * (time.perf_counter() - start))
            ddp.finish_param_sync()
            times[name]["all_ms"].append(1e3 * (time.perf_counter() - start))
    ddp.forward_order = forward
    return {"buckets": len(ddp.buckets), **{name: {k: round(statistics.median(v), 2) for k, v in d.items()}
                                            for name, d in times.items()}}


def torch_barrier():
    import torch.distributed as dist

    dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--bucket-size", type=int, default=200_000)
    args = p.parse_args()
    from megand.tools.spawn import run_distributed

    out = run_distributed(_worker, 2, args.hidden, args.layers, args.bucket_size, args.rounds)[0]
    print(json.dumps({"dp": 2, "hidden": args.hidden, "layers": args.layers, "bucket_size": args.bucket_size, **out}))


if __name__ == "__main__":
    main()
