"""FP8 training against bf16: the loss curve, and the bytes the collectives move per step (counted, not timed).

``--curve``: runs of the same model, data and seed in bf16 and under each FP8 recipe, at each ``--layout``
(one process, tp=2 + sp, dp=2 under ZeRO-3); prints each run's losses, the largest relative gap to the
bf16 run of the same layout over the steps (and over the last 10), and each layout's largest relative
difference from the first layout's run of the same recipe.

``--bytes``: one training step of ``tiny_llama`` on 2 ranks, bf16 and FP8 (tensorwise; first and last
layers in bf16 as by default, and every layer in FP8; at dp=2 every recipe), at tp=2 with
sequence parallelism and at dp=2 under ZeRO-3; counts the bytes this rank sends through the
sequence-parallel all-gathers (at the collective: the tensor handed to it) and the data-parallel engine's
parameter all-gathers (its own traffic counter: all of them, the FP8 ones apart, and the all-reduce of the
amaxes that agrees the scales), and the ZeRO-3 gathers' total relative to bf16.

``--layouts``: ``tiny_llama`` for 10 steps in FP8 on one process, at tp=2 with sequence parallelism and at
dp=2 under ZeRO-3 (every layer in FP8); prints each layout's largest relative difference of the loss and
the grad norm from the one-process FP8 run, per recipe (and of bf16 layouts from the bf16 run).

    python benchmarks/bench_fp8.py --curve --iters 50
    python benchmarks/bench_fp8.py --curve --model llama_50m --seq-length 64 --layout tp2_sp dp2_zero3
    python benchmarks/bench_fp8.py --curve --model llama_50m --seq-length 64 --global-batch-size 32 --lr 3e-4 --warmup-iters 10 --layout tp2_sp dp2_zero3
    python benchmarks/bench_fp8.py --bytes
    python benchmarks/bench_fp8.py --layouts
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# a small LLaMA (the llama_50m shape scaled down to run 50 steps on a CPU in about a minute per run)
SMALL = ["model=llama_50m", "model.num_layers=6", "model.hidden_size=256", "model.ffn_hidden_size=704",
         "model.num_attention_heads=4", "model.num_query_groups=2", "model.seq_length=128", "model.vocab_size=4096"]


def run_metrics(run_dir, overrides, nproc=1):
    """The training lines of metrics.jsonl of ``pretrain_gpt.py`` on ``nproc`` local ranks."""
    from megand.tools.spawn import free_port

    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), f"run_dir={run_dir}", *overrides]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc),
           "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0"}
    ranks = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(nproc)]
    if any(rank.wait() for rank in ranks):
        raise RuntimeError(f"{' '.join(cmd)} failed on {nproc} ranks")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def run_losses(run_dir, overrides):
    return [r["loss"] for r in run_metrics(run_dir, overrides)]


def layouts(args):
    common = ["+experiment=tiny_llama", "train.precision=bf16", "train.fp8_bf16_layers=0", "train.eval_iters=0"]
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in ("bf16", *args.recipes):  # bf16: how far bf16 layouts are from the bf16 run
            base = [*common] if recipe == "bf16" else [*common, f"train.fp8={recipe}"]
            ref = run_metrics(os.path.join(tmp, f"{recipe}_1"), base)
            for name, extra in (("tp2_sp", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
                                ("dp2_zero3", ["optim.sharding=optim_grads_params"])):
                run = run_metrics(os.path.join(tmp, f"{recipe}_{name}"), [*base, *extra], nproc=2)
                table[f"{recipe}/{name}"] = {key: max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(run, ref))
                                             for key in ("loss", "grad_norm")}
                print(recipe, name, table[f"{recipe}/{name}"], flush=True)
    print(json.dumps(table, indent=1))


CURVE_LAYOUTS = {"one": (1, []), "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
                 "dp2_zero3": (2, ["optim.sharding=optim_grads_params"])}


def curve(args):
    model = SMALL if args.model is None else [f"model={args.model}"]
    if args.seq_length:
        model = [*model, f"model.seq_length={args.seq_length}"]
    common = [*model, "data=quickstart", f"data.cache_dir={args.cache_dir}", "train.precision=bf16",
              f"train.iters={args.iters}", f"train.global_batch_size={args.global_batch_size}", "train.micro_batch_size=4",
              "train.eval_iters=0", f"optim.lr={args.lr}", f"optim.warmup_iters={args.warmup_iters}"]
    out, summary = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layout:
            nproc, extra_layout = CURVE_LAYOUTS[layout]
            for name in ("bf16", *args.recipes):
                extra = [] if name == "bf16" else [f"train.fp8={name}"]
                key = f"{layout}/{name}"
                out[key] = [r["loss"] for r in run_metrics(os.path.join(tmp, key.replace("/", "_")),
                                                            [*common, *extra_layout, *extra], nproc)]
                print(key, " ".join(f"{v:.4f}" for v in out[key]), flush=True)
            bf16 = out[f"{layout}/bf16"]
            for name in args.recipes:
                run = out[f"{layout}/{name}"]
                gaps = [abs(a - b) / b for a, b in zip(run, bf16)]
                summary[f"{layout}/{name}"] = {"max_rel_gap": max(gaps), "max_rel_gap_last10": max(gaps[-10:]),
                                               "final_loss": run[-1], "bf16_final_loss": bf16[-1]}
    first = args.layout[0]
    for layout in args.layout[1:]:  # the same arithmetic at another layout: its difference from the first
        for name in ("bf16", *args.recipes):
            a, b = out[f"{layout}/{name}"], out[f"{first}/{name}"]
            summary[f"{layout}_vs_{first}/{name}"] = {"max_rel_diff": max(abs(x - y) / abs(y) for x, y in zip(a, b))}
    print(json.dumps({"losses": out, "summary": summary}, indent=1))


def _bytes_worker(overrides):
    import torch
    import torch.distributed as dist

    from megand.core.tensor_parallel import mappings
    from megand.training.config import compose
    from megand.training.pretrain import Trainer

    sent = {"sp_all_gather": 0}
    gather = mappings.all_gather_flat

    def counting(out, x, group=None, **kwargs):
        sent["sp_all_gather"] += x.nbytes * (dist.get_world_size(group) - 1)  # ring: (n-1) shards per rank
        return gather(out, x, group=group, **kwargs)

    mappings.all_gather_flat = counting
    run_dir = tempfile.mkdtemp(prefix="bench_fp8_")
    trainer = Trainer(compose(["+experiment=tiny_llama", f"run_dir={run_dir}", "train.precision=bf16", *overrides]))
    count = trainer.ddp.count
    fp8_gathers = {"zero3_fp8_all_gather": 0}

    def counting_fp8(kind, full, ranks):  # FP8 bytes (uint8) of the FP8 layers' weights, counted apart
        before = trainer.ddp.traffic[kind]
        count(kind, full, ranks)
        if kind == "all_gather" and full.dtype == torch.uint8:
            fp8_gathers["zero3_fp8_all_gather"] += trainer.ddp.traffic[kind] - before

    trainer.ddp.count = counting_fp8
    trainer.ddp.traffic.update(dict.fromkeys(trainer.ddp.traffic, 0))
    sent["sp_all_gather"] = 0
    trainer.step()
    return {**sent, "zero3_param_all_gather": trainer.ddp.traffic["all_gather"], **fp8_gathers,
            "zero3_scale_all_reduce": trainer.ddp.traffic["all_reduce"]}


def count_bytes(_args):
    from megand.tools.spawn import run_distributed

    layouts = {"tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
               "dp2_zero3": ["optim.sharding=optim_grads_params"]}
    table = {}
    for layout, overrides in layouts.items():
        runs = [("bf16", []), ("fp8_tensorwise", ["train.fp8=tensorwise"])]
        runs += [(f"fp8_{recipe}_all_layers", [f"train.fp8={recipe}", "train.fp8_bf16_layers=0"])
                 for recipe in (("tensorwise",) if layout == "tp2_sp" else ("tensorwise", "rowwise", "mxfp8"))]
        for name, fp8 in runs:
            table[f"{layout}/{name}"] = run_distributed(_bytes_worker, 2, [*overrides, *fp8])[0]
            print(layout, name, table[f"{layout}/{name}"], flush=True)
    bf16 = table["dp2_zero3/bf16"]["zero3_param_all_gather"]
    for key, row in table.items():
        if key.startswith("dp2_zero3/fp8"):
            row["total_vs_bf16"] = row["zero3_param_all_gather"] / bf16
    print(json.dumps(table, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--curve", action="store_true", help="loss curves of bf16 and the FP8 recipes")
    parser.add_argument("--bytes", action="store_true", help="bytes per step of the sp and ZeRO-3 all-gathers")
    parser.add_argument("--layouts", action="store_true", help="FP8 layouts against the FP8 one-process run")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise", "mxfp8"])
    parser.add_argument("--cache-dir", default=os.path.join(ROOT, "runs", "cache"))
    parser.add_argument("--model", default=None,
                        help="--curve: a conf/model name (default: the llama_50m shape scaled down, 6 x 256)")
    parser.add_argument("--seq-length", type=int, default=None, help="--curve: model.seq_length (a shorter run)")
    parser.add_argument("--global-batch-size", type=int, default=8, help="--curve: samples per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="--curve: peak learning rate")
    parser.add_argument("--warmup-iters", type=int, default=5, help="--curve: linear warmup steps")
    parser.add_argument("--layout", nargs="+", default=["one"], choices=list(CURVE_LAYOUTS),
                        help="--curve: the layouts to train at (one process, tp=2 + sp, dp=2 under ZeRO-3)")
    args = parser.parse_args()
    if not (args.curve or args.bytes or args.layouts):
        parser.error("choose --curve, --bytes and/or --layouts")
    if args.layouts:
        layouts(args)
    if args.bytes:
        count_bytes(args)
    if args.curve:
        curve(args)


if __name__ == "__main__":
    main()
