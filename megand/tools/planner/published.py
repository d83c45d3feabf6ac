"""Published large-scale runs, to keep the cost model honest: the predicted throughput of each run's
published layout (pinned) must be within 20% of the throughput the paper reports, and the planner's
own top plan on the same cluster must be predicted at least as fast.

Figures are quoted from the papers (no network here: from memory of their tables, rounded as printed):

- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  SC 2021, Table 1 (weak scaling on Selene, DGX A100 80GB, 8 x 200 Gb/s HDR InfiniBand per node):
  GPT models, sequence 2048, vocabulary 51,200, full activation recomputation, mixed precision; the
  TFLOP/s per GPU count the recomputed forward (their 96·B·s·l·h²(1 + s/6h + V/16lh) formula, which is
  our hardware FLOPs with ``full`` recompute). Their attention materialised the s x s scores (no
  FlashAttention yet), their data-parallel all-reduce ran after the backward (no overlap), without a
  distributed optimizer and without sequence parallelism (both came in 2022): pinned as such.
- Llama Team, "The Llama 3 Herd of Models", 2024, Table 4: Llama 3 405B (126 layers, hidden 16,384,
  FFN 53,248, 128 heads, 8 KV heads, vocabulary 128,256) pre-training on H100 80GB with 16M-token
  batches of 8,192-token sequences, BF16 MFU 43% / 41% = 430 / 400 TFLOP/s per GPU; the pipeline
  layout (interleaving, uneven first and last stages) and recomputation are not published in the
  table: the planner chooses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megand.tools.planner.cluster import parse_cluster
from megand.tools.planner.cost import predict
from megand.tools.planner.layout import Candidate
from megand.tools.planner.search import Planner, config_validator


def _gpt(layers: int, hidden: int, heads: int) -> dict:
    return dict(arch="gpt", num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                num_attention_heads=heads, num_query_groups=None, seq_length=2048, vocab_size=51200,
                norm="layernorm", activation="gelu", position_embedding="learned", tie_embeddings=True,
                hidden_dropout=0.0, attention_dropout=0.0)


LLAMA3_405B = dict(arch="llama", num_layers=126, hidden_size=16384, ffn_hidden_size=53248, num_attention_heads=128,
                   num_query_groups=8, seq_length=8192, vocab_size=128256, norm="rmsnorm", activation="swiglu",
                   position_embedding="rope", tie_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0)

MEGATRON_2021 = "Narayanan et al., SC21 (Megatron-LM), Table 1"
LLAMA3 = "Llama Team, The Llama 3 Herd of Models (2024), Table 4"
# how Megatron-LM 2021 ran (see the module docstring): pinned for its layout and for the search alike
_MEGATRON_PINS = dict(recompute="full", recompute_layers=None, sharding="none", overlap_grad_reduce=False, overlap_param_gather=False,
                      sequence_parallel=False, fused_attention=False)


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    model: dict
    device: str
    gpus: int
    global_batch_size: int
    layout: dict              # the published keys (Candidate fields)
    tflops_per_gpu: float     # achieved, as published
    implementation: dict = field(default_factory=dict)  # how that system ran (pinned for the search too)

    def cluster(self):
        return parse_cluster({"groups": [{"name": self.device, "nodes": self.gpus // 8, "devices_per_node": 8,
                                          "device": self.device}]}, where=self.name)


RUNS = (
    PublishedRun("GPT 145.6B, 1536 A100", MEGATRON_2021, _gpt(80, 12288, 96), "a100", 1536, 2304,
                 dict(tp=8, pp=8, dp=24, vpp=None, micro_batch_size=1), 148, _MEGATRON_PINS),
    PublishedRun("GPT 310.1B, 1920 A100", MEGATRON_2021, _gpt(96, 16384, 128), "a100", 1920, 2160,
                 dict(tp=8, pp=16, dp=15, vpp=None, micro_batch_size=1), 155, _MEGATRON_PINS),
    PublishedRun("GPT 529.6B, 2520 A100", MEGATRON_2021, _gpt(105, 20480, 128), "a100", 2520, 2520,
                 dict(tp=8, pp=35, dp=9, vpp=None, micro_batch_size=1), 163, _MEGATRON_PINS),
    PublishedRun("GPT 1008B, 3072 A100", MEGATRON_2021, _gpt(128, 25600, 160), "a100", 3072, 3072,
                 dict(tp=8, pp=64, dp=6, vpp=None, micro_batch_size=1), 163, _MEGATRON_PINS),
    PublishedRun("Llama 3 405B, 8192 H100", LLAMA3, LLAMA3_405B, "h100", 8192, 2048,
                 dict(tp=8, pp=16, cp=1, dp=64), 430),
    PublishedRun("Llama 3 405B, 16384 H100", LLAMA3, LLAMA3_405B, "h100", 16384, 2048,
                 dict(tp=8, pp=16, cp=1, dp=128), 400),
)


def _config(model: dict, global_batch_size: int):
    """The training config of a model given as a dict, composed as pretrain_gpt.py would."""
    from megand.tools.planner.layout import override_value
    from megand.training.config import compose

    return compose([f"model.{k}={override_value(v)}" for k, v in model.items()]
                   + [f"train.global_batch_size={global_batch_size}", "train.precision=bf16"])


def _planner(run: PublishedRun, pinned: dict) -> Planner:
    cfg = _config(run.model, run.global_batch_size)
    keys = {"tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp", "dp": "parallel.dp",
            "vpp": "parallel.vpp", "recompute": "train.recompute", "recompute_layers": "train.recompute_layers",
            "sharding": "optim.sharding",
            "micro_batch_size": "train.micro_batch_size", "overlap_grad_reduce": "optim.overlap_grad_reduce",
            "overlap_param_gather": "optim.overlap_param_gather", "sequence_parallel": "parallel.sequence_parallel"}
    pins = {"train.precision"}
    for k, v in pinned.items():
        if k in keys:
            from omegaconf import OmegaConf

            OmegaConf.update(cfg, keys[k], v)
            pins.add(keys[k])
    planner = Planner(cfg, pins, run.cluster(), validate_fn=config_validator(cfg))
    planner.fused_attention = run.implementation.get("fused_attention")
    return planner


def evaluate(run: PublishedRun, search: bool = True) -> dict:
    """Predicted TFLOP/s per GPU of the published layout (searching only what the paper leaves open)
    and of the planner's top plan with only the model, batch, cluster and implementation pinned."""
    # the published layout as run: one recompute choice for every layer
    published = _planner(run, {**run.implementation, **run.layout, "recompute_layers": None}).plan(1)[0]
    row = {"run": run.name, "source": run.source, "published_tflops": run.tflops_per_gpu,
           "layout": run.layout, "predicted_tflops": published.prediction.tflops_per_device,
           "predicted_tokens_per_s": published.prediction.tokens_per_s,
           "error": published.prediction.tflops_per_device / run.tflops_per_gpu - 1.0,
           "published_plan": published}
    if search:
        top = _planner(run, run.implementation).plan(1)[0]
        row.update(top_tokens_per_s=top.prediction.tokens_per_s, top_plan=top)
    return row


def main(argv=None) -> None:
    """Print the "Published runs" table of docs/layout.md (optionally only the rows numbered in argv)."""
    import sys

    rows = [int(a) for a in (sys.argv[1:] if argv is None else argv)] or range(len(RUNS))
    print("| run | cluster | layout | published TFLOP/s/GPU | predicted (published layout) | error | planner's top plan | top / published layout |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in (RUNS[i] for i in rows):
        row = evaluate(run)
        top = row["top_plan"].candidate
        lay = " ".join(f"{k}={v}" for k, v in run.layout.items())
        print(f"| {run.name} | {run.gpus} {run.device} | {lay} | {run.tflops_per_gpu:g} | "
              f"{row['predicted_tflops']:.0f} | {row['error']:+.0%} | tp={top.tp} pp={top.pp} vpp={top.vpp} "
              f"cp={top.cp} dp={top.dp} mbs={top.micro_batch_size} {top.recompute} {top.sharding} | "
              f"{row['top_tokens_per_s'] / row['predicted_tokens_per_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
