"""The run's configuration: a structured schema (unknown keys are errors), the checks of its values, and
the translation into core's own typed configs.

Hydra composes ``conf/`` on top of :class:`Config`; :func:`validate` then checks every value and every
divisibility the layout needs, before any work, and names the offending values. This is the only
package that reads the Hydra config for core: :func:`transformer_config` here (validation uses it too) and
``megand.training.core_configs``, which turns the whole config into core's typed configs once per start-up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from megand.core.tensor_parallel.fp8_recipes import RECIPES as FP8_RECIPES
from megand.core.transformer.config import NORM_PLACEMENTS, QK_NORM_SCOPES
from megand.data.source import DATA_KINDS, STREAM
from megand.training.model_schema import ModelConfig  # the model group: generated from core's TransformerConfig


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    vpp: Optional[int] = None  # model chunks per pipeline rank (interleaved 1F1B); null: no interleaving
    pp_schedule: str = "1f1b"  # pipeline schedule: 1f1b (interleaved when vpp is set) | zb1p (zero bubble ZB-H1: backward split into input- and weight-gradient passes; one chunk per rank) | zbv, dualpipev (two chunks per rank in a V, vpp=2; loss on pp rank 0)
    cp: int = 1  # context-parallel size (sequence split over ranks)
    dp: Optional[int] = None  # null: world size / (tp*pp*cp)
    sequence_parallel: bool = False  # shard norms/dropout activations over tp along the sequence
    order: str = "tp-cp-dp-pp"  # fastest- to slowest-varying rank dimension
    pipeline_layout: Optional[List[Any]] = None  # layers per virtual stage; null: even; or per virtual stage {layers: n, tp: w, sp: bool} (tp, sp default parallel.tp, parallel.sequence_parallel): stages of different tensor-parallel widths (the virtual stages of one pipeline rank share its width)
    cp_comm: str = "p2p"  # p2p (ring) | all_gather | a2a (Ulysses: heads re-sharded over cp)
    dp_shard: Optional[int] = None  # ranks of dp x cp in one shard group (optim.sharding != none); null: all; smaller: hybrid sharding (HSDP), replicas across groups
    ep: int = 1  # expert-parallel size: routed experts split over ep ranks carved out of dp x cp (divides dp*cp and model.num_experts); expert grads are reduced over the remaining expert-data-parallel ranks
    etp: Optional[int] = None  # expert tensor-parallel size (MoE): 1 (whole experts on every tp rank, tokens split over tp) or tp; null: tp
    dp_microbatches: Optional[List[int]] = None  # micro-batches per data-parallel replica and step (heterogeneous clusters: a fast replica takes more); null: equal shares; sums to train.global_batch_size / train.micro_batch_size


@dataclass
class TrainConfig:
    iters: int = 100  # optimizer steps
    global_batch_size: int = 8  # samples per step, whatever the layout
    micro_batch_size: int = 2  # samples per forward/backward on one data-parallel rank
    seed: int = 1234  # seeds init (per parameter name), data order and dropout
    precision: str = "fp32"  # fp32 | bf16 | fp16
    fp8: Optional[str] = None  # null | tensorwise | rowwise | mxfp8: the transformer layers' linear and expert GEMMs in FP8 (needs precision=bf16)
    fp8_bf16_layers: int = 1  # with fp8: this many first and last transformer layers stay in bf16 (the output layer and the router always do)
    recompute: str = "none"  # none | selective | full
    recompute_layers: Optional[List[int]] = None  # per (virtual) pipeline stage, in parallel.pipeline_layout's order: how many of its layers (its first ones) apply train.recompute, the others store their activations; null: every layer
    compile: bool = False  # torch.compile each transformer layer (regional compilation); the compile time is printed after the first step
    log_interval: int = 1  # console line and metrics.jsonl every N steps
    batch_checksum: bool = False  # log a checksum of each global batch's tokens (batch_checksum in metrics.jsonl; a test aid)
    eval_interval: int = 0  # 0: evaluate only at the end
    eval_iters: int = 2  # validation batches per evaluation (0: no evaluation)
    max_skipped_steps: int = 10  # stop (exit code 3) after this many consecutive steps skipped for a non-finite loss or grad norm
    spike_factor: float = 3.0  # a loss above this times the running median of recent steps is a spike
    spike_window: int = 20  # recent steps in the running median; the spike guard starts once it is full
    spike_rollback: bool = False  # on a spike reload the last checkpoint and skip the data up to the spike
    max_rollbacks: int = 3  # spike rollbacks allowed in one run; later spikes are only logged
    hang_report_ops: int = 1000  # operations per process kept by torch's flight recorder for the hang report (run_dir/hang/); 0: none
    collective_timeout_s: Optional[float] = None  # hang watchdog (no step progress for this long dumps stacks and exits) and the process groups' collective timeout; null: 600 on GPU, 1800 on CPU
    straggler_ratio: float = 1.3  # warn when the slowest rank's busy time exceeds the median by this factor
    exit_duration_mins: Optional[float] = None  # save and exit 0 at the first step boundary after this many minutes
    exit_interval: Optional[int] = None  # save and exit 0 after this iteration
    rampup_batch_size: Optional[List[int]] = None  # [start, increment, ramp_samples]: the global batch grows from start by increment every ramp_samples / ((global_batch_size - start) / increment) samples (Megatron's rule); null: constant


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon (hidden matrices orthogonalised by Newton-Schulz; AdamW for embeddings, output layer, norms, biases, router) | lion (sign of the interpolated momentum, one fp32 moment; beta1, beta2, weight_decay, lr below)
    muon_momentum: float = 0.95  # muon: momentum coefficient
    muon_nesterov: bool = True  # muon: Nesterov momentum
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations
    lr: float = 3.0e-4  # peak learning rate
    min_lr: float = 3.0e-5  # learning rate at the end of the decay
    warmup_iters: int = 10  # linear warm-up steps
    decay_iters: Optional[int] = None  # null: train.iters
    schedule: str = "cosine"  # cosine | linear | constant | wsd (warmup-stable-decay: peak until the decay start, then decay_style to min_lr)
    decay_style: str = "1-sqrt"  # wsd: decay shape, linear | cosine | 1-sqrt
    decay_fraction: float = 0.2  # wsd: the last decay_fraction x decay_iters steps decay
    decay_start: Optional[int] = None  # wsd: decay after this step instead (cooldown from a stable checkpoint: its iteration); null: from decay_fraction
    weight_decay: float = 0.1  # decoupled decay (AdamW, Muon, Lion) on matrices and embeddings (not on biases and norms)
    beta1: float = 0.9  # Adam beta1; lion: the interpolation of momentum and gradient whose sign is the update
    beta2: float = 0.95  # Adam beta2; lion: the momentum's decay
    eps: float = 1.0e-8  # Adam epsilon
    clip_grad: float = 1.0  # 0: no clipping
    sharding: str = "none"  # none | optim (ZeRO-1) | optim_grads (ZeRO-2) | optim_grads_params (ZeRO-3, FSDP): what is kept only as this rank's shard of the dp x cp (or dp_shard) group
    reshard_after_forward: bool = True  # ZeRO-3: free gathered params after each module's forward, gather again for backward (false: keep them until the backward)
    distributed: Optional[bool] = None  # removed: use optim.sharding (optim.distributed=true is optim.sharding=optim)
    overlap_grad_reduce: bool = False  # reduce gradient buckets during backward
    overlap_param_gather: bool = False  # all-gather updated params during the next forward (optim.sharding=optim or optim_grads)
    bucket_size: int = 40_000_000  # elements per gradient bucket
    initial_loss_scale: float = 65536.0  # fp16 dynamic loss scale at start
    loss_scale_window: int = 1000  # fp16: steps without overflow before the scale doubles
    hysteresis: int = 2  # fp16: overflows tolerated before the scale halves
    min_loss_scale: float = 1.0  # fp16: the scale never goes below this


@dataclass
class DataConfig:
    kind: str = "mock"  # mock | indexed | quickstart (the offline pydoc corpus, built once into cache_dir) | stream | hf_disk (a datasets save_to_disk directory, streamed)
    paths: List[Any] = field(default_factory=list)  # [[weight, prefix], ...]
    tokenizer: Optional[str] = None  # path to a sentencepiece .model, a Hugging Face tokenizer.json or a .tiktoken file
    tokenizer_type: Optional[str] = None  # sentencepiece | huggingface | tiktoken (null: from the file name: .model, .json, .tiktoken)
    eod_id: Optional[int] = None  # end-of-document id (null: the tokenizer's own EOS / <|endoftext|>)
    reset_attention_mask: bool = False  # tokens attend only within their document (documents end at the EOD id)
    reset_position_ids: bool = False  # positions restart at 0 after each EOD
    eod_mask_loss: bool = False  # no loss where the input token is EOD (the prediction across a document boundary)
    split: str = "969,30,1"  # train,valid,test proportions of documents
    cache_dir: str = "${run_dir}/data_cache"  # where dataset indices (and the quickstart corpus) are cached
    on_error: str = "fail"  # stream: a malformed row stops the run (fail) or is skipped (skip)
    workers: int = 1  # stream: tokenizer processes per reader (one reader per data-parallel rank); 0: in the reader
    text_key: str = "text"  # stream, hf_disk: the JSON field, Parquet or Arrow column holding each document's text
    valid_paths: List[Any] = field(default_factory=list)  # stream: the held-out validation stream, [[weight, directory or glob], ...] (no file of data.paths); read from its start at every evaluation


@dataclass
class CheckpointConfig:
    save: Optional[str] = None  # directory of iter_NNNNNNN/ checkpoints and `latest`
    load: Optional[str] = None  # checkpoint directory (or iter dir) to resume from
    interval: int = 0  # 0: only at the end (and on SIGTERM/SIGINT)
    async_save: bool = False  # write checkpoints in the background after a copy to CPU
    keep_last: Optional[int] = None  # keep only the newest N iter_* directories after each save; null: keep all
    continue_on_error: bool = False  # a failed save never stops the run, the final one included (it only warns)
    max_failed_saves: int = 3  # consecutive failed saves before the run stops (exit code 5); a failed final save also stops it
    local_dir: Optional[str] = None  # node-local directory of the fast tier (the same path on every node, each node's own disk); each rank's state is also replicated to a peer node; null: no local tier
    local_interval: int = 0  # save to local_dir every N iterations (needs local_dir; cheaper and more frequent than interval)
    save_timeout_s: Optional[float] = None  # longest a checkpoint save may take before it counts as failed, and a load before the hang watchdog fires (also their collectives' timeout); null: the larger of 3600 and train.collective_timeout_s


@dataclass
class WandbConfig:
    enabled: bool = False  # log to Weights & Biases (from the logging rank)
    project: str = "megand"  # wandb project
    name: Optional[str] = None  # wandb run name (default: the run's name)
    mode: str = "offline"  # offline | online | disabled


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class Config:
    name: str = "default"  # run name; experiments set it
    run_dir: str = "runs/${name}"  # every artifact of the run goes here; identical on all ranks
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    hydra: Any = MISSING  # filled by Hydra; not ours


def register_schema() -> None:
    """Make ``base_config`` (the schema) available to ``conf/config.yaml``'s defaults list."""
    ConfigStore.instance().store(name="base_config", node=Config)


# conf/ of the source tree (megand is installed from it: ``pip install -e .``)
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")

CHOICES = {
    "model.arch": ("gpt", "llama"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.activation": ("gelu", "swiglu", "geglu"),
    "model.norm_placement": NORM_PLACEMENTS,
    "model.qk_norm_scope": QK_NORM_SCOPES,
    "model.position_embedding": ("learned", "rope"),
    "model.moe_router": ("softmax", "sigmoid"),
    "parallel.cp_comm": ("p2p", "all_gather", "a2a"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.recompute": ("none", "selective", "full"),
    "optim.schedule": ("cosine", "linear", "constant", "wsd"),
    "optim.decay_style": ("linear", "cosine", "1-sqrt"),
    "optim.sharding": ("none", "optim", "optim_grads", "optim_grads_params"),
    "data.kind": tuple(DATA_KINDS),
    "data.on_error": ("fail", "skip"),
    "logging.wandb.mode": ("offline", "online", "disabled"),
}


class ConfigError(ValueError):
    """An invalid configuration; raised before any work, naming the keys and values."""


def _get(cfg, dotted):
    for key in dotted.split("."):
        cfg = cfg[key]
    return cfg


def check_keys(cfg) -> None:
    """Unknown keys are errors, also those forced in with Hydra's ``+key=value``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    user = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    try:
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.to_container(user))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{e.msg if hasattr(e, 'msg') else e} (full key: {getattr(e, 'full_key', '?')})") from None


def check_expert_parallel(cfg, layout) -> None:
    """parallel.ep / parallel.etp against the layout and the experts; ConfigError naming the values."""
    from megand.core.parallel_state import LayoutError, expert_rank_groups

    m, p = cfg.model, cfg.parallel
    try:
        expert_rank_groups(layout)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    experts = m.get("num_experts")
    if p.ep > 1 and not experts:
        raise ConfigError(f"parallel.ep={p.ep} needs a Mixture-of-Experts model (model.num_experts is null)")
    if experts and experts % p.ep:
        raise ConfigError(f"model.num_experts={experts} is not divisible by parallel.ep={p.ep}")
    if p.ep > 1 and p.dp_shard is not None and p.dp_shard != layout.dp_cp:
        raise ConfigError(f"parallel.dp_shard={p.dp_shard} (hybrid sharding) with parallel.ep={p.ep} is not supported: "
                          f"expert weights shard over their whole expert-data-parallel group; unset parallel.dp_shard")


def check_fp8(t) -> None:
    """``train.fp8``: a known recipe, on a bf16 model."""
    fp8 = t.get("fp8")
    if fp8 is None:
        return
    if fp8 not in FP8_RECIPES:
        raise ConfigError(f"train.fp8={fp8!r}: expected null or one of {', '.join(FP8_RECIPES)}")
    if t.precision != "bf16":
        raise ConfigError(f"train.fp8={fp8} needs train.precision=bf16 (got {t.precision})")
    if t.fp8_bf16_layers < 0:
        raise ConfigError(f"train.fp8_bf16_layers={t.fp8_bf16_layers} must be >= 0")


def check_fp8_device(fp8, device) -> None:
    """A recipe whose record ``needs`` its kernel (``train.fp8=mxfp8``: MX block-scaled tensor cores, from
    Blackwell) on a GPU without it is refused: its emulation there runs slower than bf16. On the CPU the
    emulation is the reference and runs."""
    from megand.core.parallel_state import device_capability
    from megand.core.tensor_parallel.fp8 import Fp8Kernels

    rec = FP8_RECIPES.get(fp8)
    if rec is None or rec.needs is None:
        return
    capability = device_capability(device)
    if capability is None or getattr(Fp8Kernels.for_capability(capability), rec.kernel):
        return
    import torch

    others = " or ".join(reversed([r.name for r in FP8_RECIPES.values() if r.needs is None]))  # finest first
    raise ConfigError(f"train.fp8={fp8} needs {rec.needs}; {torch.cuda.get_device_name(device)} is "
                      f"{capability[0]}.{capability[1]}: use train.fp8={others} ({rec.needs_why})")


def check_stage_widths(cfg, layout) -> None:
    """Pipeline stages of different tensor-parallel widths (the per-stage ``parallel.pipeline_layout``):
    every width divides what tp splits, and what they cannot run is refused, naming the values."""
    if not layout.heterogeneous:
        return
    m, p = cfg.model, cfg.parallel
    widths = list(layout.stage_tp)
    groups = m.num_query_groups or m.num_attention_heads
    for w in sorted(set(widths)):
        for ok, what in ((m.num_attention_heads % w == 0, f"model.num_attention_heads={m.num_attention_heads}"),
                         (groups % w == 0 or w % groups == 0, f"model.num_query_groups={groups} (or the reverse)"),
                         (m.ffn_hidden_size % w == 0, f"model.ffn_hidden_size={m.ffn_hidden_size}")):
            if not ok:
                raise ConfigError(f"{what} is not divisible by the stage width tp={w} of parallel.pipeline_layout "
                                  f"(stage widths {widths})")
    if m.tie_embeddings and widths[0] != widths[-1]:
        raise ConfigError(f"model.tie_embeddings with first and last stage widths tp={widths[0]} and tp={widths[-1]} "
                          f"(parallel.pipeline_layout): the tied embedding's two copies must have one width")
    unsupported = [(p.tp != 1 and p.tp not in widths, f"parallel.tp={p.tp} is none of the stage widths {widths}: "
                                                       f"leave it 1 and give each stage its tp"),
                   (m.get("num_experts") is not None, f"model.num_experts={m.get('num_experts')}: MoE"),
                   (m.get("mtp_layers", 0), f"model.mtp_layers={m.get('mtp_layers')}: multi-token prediction"),
                   (p.cp > 1 and p.cp_comm == "a2a", "parallel.cp_comm=a2a"),
                   (cfg.train.get("fp8") is not None, f"train.fp8={cfg.train.get('fp8')}")]
    for bad, what in unsupported:
        if bad:
            raise ConfigError(f"{what} with stages of different widths (parallel.pipeline_layout stage widths "
                              f"{widths}) is not supported")


def validate(cfg, world_size: int) -> None:
    """Check every value and divisibility; raise ConfigError naming the values."""
    from megand.core.parallel_layout import LayoutError, ParallelLayout
    from megand.core.parallel_state import choose_device_and_backend
    from megand.core.pipeline_parallel.layout import PipelineLayoutError, pipeline_layout
    from megand.core.transformer.config import resolve_head_dim

    check_keys(cfg)
    if cfg.optim.get("distributed") is not None:
        level = "optim" if cfg.optim.distributed else "none"
        raise ConfigError(f"optim.distributed={cfg.optim.distributed} was replaced by optim.sharding: use "
                          f"optim.sharding={level} (none|optim|optim_grads|optim_grads_params)")
    from megand.core.optimizer.registry import OPTIMIZERS

    for key, allowed in {**CHOICES, "optim.name": tuple(OPTIMIZERS)}.items():
        if _get(cfg, key) not in allowed:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: expected one of {', '.join(allowed)}")
    m, p, t = cfg.model, cfg.parallel, cfg.train
    check_fp8(t)
    check_fp8_device(t.get("fp8"), choose_device_and_backend()[0])
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                "make_vocab_size_divisible_by"):
        if m[key] < 1:
            raise ConfigError(f"model.{key}={m[key]} must be positive")
    check_counts(cfg)
    try:
        layout = ParallelLayout.from_keys(p, world_size)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if cfg.optim.sharding == "none" and layout.shard_size != layout.dp_cp:
        raise ConfigError(f"parallel.dp_shard={p.dp_shard} shards nothing with optim.sharding=none: set optim.sharding")
    check_expert_parallel(cfg, layout)
    check_stage_widths(cfg, layout)
    groups = m.num_query_groups or m.num_attention_heads
    latent = m.kv_lora_rank is not None  # latent attention: its widths are checked by core's config
    head_dim = resolve_head_dim(m.hidden_size, m.num_attention_heads, m.head_dim)
    checks = [
        (latent or m.head_dim is not None or m.hidden_size % m.num_attention_heads == 0,
         f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads} "
         f"(or set model.head_dim)"),
        (m.head_dim is None or m.head_dim >= 1, f"model.head_dim={m.head_dim} must be positive (or null)"),
        (m.num_attention_heads % groups == 0,
         f"model.num_attention_heads={m.num_attention_heads} is not divisible by model.num_query_groups={groups}"),
        (m.num_attention_heads % p.tp == 0,
         f"model.num_attention_heads={m.num_attention_heads} is not divisible by parallel.tp={p.tp}"),
        # fewer key/value heads than ranks: each is replicated over the tp / groups ranks whose queries use it
        (groups % p.tp == 0 or p.tp % groups == 0,
         f"model.num_query_groups={groups} and parallel.tp={p.tp}: one must divide the other"),
        (groups >= p.tp or OPTIMIZERS[cfg.optim.name].matrix_flops is None,
         f"optim.name={cfg.optim.name} with model.num_query_groups={groups} < parallel.tp={p.tp}: it transforms "
         f"each whole matrix of the fused QKV, which the replicated key/value heads cut; use an elementwise "
         f"optimizer or parallel.tp <= {groups}"),
        (groups >= p.tp or not m.get("attention_output_gate", False),
         f"model.attention_output_gate with model.num_query_groups={groups} < parallel.tp={p.tp}: not supported; "
         f"use parallel.tp <= {groups}"),
        (m.ffn_hidden_size % p.tp == 0, f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by parallel.tp={p.tp}"),
        (latent or m.position_embedding != "rope" or head_dim % 2 == 0, f"rope needs an even head dim, got {head_dim}"),
        (layout.dp_microbatches is not None or  # the shares' own check below
         t.micro_batch_size >= 1 and t.global_batch_size % (t.micro_batch_size * layout.dp) == 0,
         f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size={t.micro_batch_size}"
         f" x dp={layout.dp} = {t.micro_batch_size * layout.dp}"),
    ]
    seq_multiple = layout.sequence_multiple(p.sequence_parallel)
    checks.append((m.seq_length % seq_multiple == 0,
                   f"model.seq_length={m.seq_length} is not divisible by {seq_multiple} "
                   f"(2*cp={2 * p.cp if p.cp > 1 else 1} x tp={p.tp if p.sequence_parallel else 1} under sequence parallelism)"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    from megand.training.rampup import ramp_error

    rule = layout.schedule.microbatch_rule(p.pp, p.vpp)  # the schedule's rule, for every batch size the run takes
    if layout.dp_microbatches is not None:
        validate_batch_shares(cfg, layout, rule)
    else:
        ramp_message = ramp_error(t, t.micro_batch_size * layout.dp, rule)
        if ramp_message:
            raise ConfigError(ramp_message)
        micro_batches = t.global_batch_size // (t.micro_batch_size * layout.dp)
        schedule_message = rule.error(micro_batches, f"{micro_batches} = global batch {t.global_batch_size} / (micro "
                                                     f"batch {t.micro_batch_size} x dp {layout.dp})", keys="parallel.")
        if schedule_message:
            raise ConfigError(schedule_message)
    try:
        layers = pipeline_layout(m.num_layers, p.pp, p.vpp, p.pipeline_layout)
        check_recompute_layers(t, layers)
    except PipelineLayoutError as e:
        raise ConfigError(str(e)) from None
    if p.cp > 1 and p.cp_comm == "a2a" and (m.num_attention_heads // p.tp) % p.cp:
        raise ConfigError(f"parallel.cp_comm=a2a re-shards heads over cp: the query heads per tensor-parallel rank "
                          f"(model.num_attention_heads={m.num_attention_heads} / parallel.tp={p.tp}) must be "
                          f"divisible by parallel.cp={p.cp} (model.num_query_groups={groups})")
    if p.cp > 1 and m.attention_dropout > 0:
        raise ConfigError(f"model.attention_dropout={m.attention_dropout} is not supported with parallel.cp={p.cp}")
    linear = "linear_attention" in (m.get("layer_types") or ())
    if linear and m.linear_num_key_heads % p.tp:
        raise ConfigError(f"model.linear_num_key_heads={m.linear_num_key_heads} is not divisible by parallel.tp={p.tp}")
    if linear and p.cp > 1 and m.seq_length // (2 * p.cp) < m.linear_conv_kernel - 1:
        raise ConfigError(f"model.seq_length={m.seq_length} gives {m.seq_length // (2 * p.cp)} tokens per context-parallel "
                          f"chunk (2 x parallel.cp={p.cp} chunks): Gated DeltaNet's convolution needs "
                          f"model.linear_conv_kernel - 1 = {m.linear_conv_kernel - 1}")
    _validate_data_kind(cfg)
    _validate_tokenizer(cfg.data, m.vocab_size)
    if cfg.data.reset_attention_mask and m.attention_dropout > 0:
        raise ConfigError(f"data.reset_attention_mask=true does not support model.attention_dropout="
                          f"{m.attention_dropout}: set it to 0")
    if not m.norm_eps > 0:
        raise ConfigError(f"model.norm_eps={m.norm_eps} must be > 0")
    validate_moe(cfg, layout)
    validate_mtp(cfg)
    validate_fault_keys(cfg)
    shape = transformer_config(cfg)  # the model schema's own checks (unknown keys, rope_scaling, unused keys)
    validate_layer_shapes(shape, cfg, layout, layers)


def validate_layer_shapes(shape, cfg, layout, layers_per_stage) -> None:
    """The full-attention layers' own key/value heads (``model.num_global_query_groups``) at each tensor-parallel
    width, and each layer that reads an earlier layer's keys and values (``model.num_kv_shared_layers``) on that
    layer's (virtual) pipeline stage: megand sends no keys and values between stages."""
    groups = shape.num_global_query_groups
    if groups is not None:
        for w in sorted(set(layout.stage_tp if layout.heterogeneous else [cfg.parallel.tp])):
            if groups % w and w % groups:
                raise ConfigError(f"model.num_global_query_groups={groups} and tp={w}: one must divide the other")
            if groups < w and _whole_matrix_optimizer(cfg):
                raise ConfigError(f"optim.name={cfg.optim.name} with model.num_global_query_groups={groups} < tp={w}: "
                                  f"it transforms each whole matrix of the fused QKV, which the replicated key/value "
                                  f"heads cut; use an elementwise optimizer or tp <= {groups}")
    if not shape.num_kv_shared_layers:
        return
    stage_of, first = {}, 0
    for stage, n in enumerate(layers_per_stage):
        stage_of.update(dict.fromkeys(range(first, first + n), stage))
        first += n
    for i in range(shape.num_layers):
        j = shape.kv_source(i)
        if j is not None and stage_of[j] != stage_of[i]:
            raise ConfigError(f"model.num_kv_shared_layers={shape.num_kv_shared_layers}: layer {i} reads the keys and "
                              f"values of layer {j}, on another (virtual) pipeline stage (layers per stage "
                              f"{list(layers_per_stage)}): set parallel.pipeline_layout so that both are on one")


def _whole_matrix_optimizer(cfg) -> bool:
    """Whether ``optim.name`` transforms each whole matrix (Muon), which replicated key/value heads cut."""
    from megand.core.optimizer.registry import OPTIMIZERS

    return OPTIMIZERS[cfg.optim.name].matrix_flops is not None


def validate_batch_shares(cfg, layout, rule) -> None:
    """``parallel.dp_microbatches`` (megand/core/batch_shares.py): the shares split the global batch, each
    replica runs what its pipeline schedule needs, and no group that meets per micro-batch spans replicas
    of different shares."""
    from megand.core.batch_shares import group_error, microbatch_count_error
    from megand.core.parallel_state import rank_groups

    t, shares = cfg.train, layout.dp_microbatches
    message = microbatch_count_error(shares, t.global_batch_size, t.micro_batch_size)
    if message:
        raise ConfigError(message)
    if t.rampup_batch_size is not None:
        raise ConfigError(f"train.rampup_batch_size={list(t.rampup_batch_size)} changes the global batch that "
                          f"parallel.dp_microbatches={list(shares)} splits: use one or the other")
    for r, k in enumerate(shares):
        message = rule.error(k, f"{k} = parallel.dp_microbatches[{r}]", keys="parallel.")
        if message:
            raise ConfigError(message)
    # ZeRO-2/3 shard groups may span shares at pp=1 (phantom micro-batches join their collectives); behind a
    # pipeline each stage's collectives follow its schedule's order, which no phantom replays
    per_microbatch_shards = cfg.optim.sharding in ("optim_grads", "optim_grads_params") and layout.pp > 1
    kinds = ["ep"] + per_microbatch_shards * ["dp_shard"] + (per_microbatch_shards and layout.ep > 1) * ["expert_dp"]
    why = (f"optim.sharding={cfg.optim.sharding} with parallel.pp={layout.pp}; at parallel.pp=1 phantom "
           f"micro-batches join them, and optim.sharding=optim meets once per step")
    message = group_error(shares, lambda r: layout.coords(r)["dp"], rank_groups(layout), kinds,
                          notes={"dp_shard": why, "expert_dp": why})
    if message:
        raise ConfigError(message)


def validate_mtp(cfg) -> None:
    """Multi-token prediction: its depth count, and the layouts it composes with."""
    m, p = cfg.model, cfg.parallel
    if not isinstance(m.mtp_layers, int) or m.mtp_layers < 0 or m.mtp_layers >= m.seq_length:
        raise ConfigError(f"model.mtp_layers={m.mtp_layers} must be an int in [0, model.seq_length={m.seq_length})")
    if m.mtp_layers and p.cp > 1:  # depth k reads the labels k positions ahead: across a cp chunk's end
        raise ConfigError(f"model.mtp_layers={m.mtp_layers} is not supported with parallel.cp={p.cp}: each depth's "
                          f"inputs and targets are the labels shifted along the whole sequence (use cp=1)")
    if m.mtp_layers and not m.mtp_loss_weight >= 0:
        raise ConfigError(f"model.mtp_loss_weight={m.mtp_loss_weight} must be >= 0")


def validate_moe(cfg, layout) -> None:
    """The Mixture-of-Experts keys and their layout (``layout``: the run's ParallelLayout, checked)."""
    m, p = cfg.model, cfg.parallel
    if m.num_experts is None:
        if p.ep != 1:
            raise ConfigError(f"parallel.ep={p.ep} needs a Mixture-of-Experts model (model.num_experts is null)")
        return
    if m.num_experts < 1:
        raise ConfigError(f"model.num_experts={m.num_experts} must be >= 1 (or null: dense)")
    if not 1 <= m.moe_top_k <= m.num_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must be between 1 and model.num_experts={m.num_experts}")
    checks = [
        (m.moe_ffn_hidden_size is None or m.moe_ffn_hidden_size >= 1,
         f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} must be >= 1 (or null: model.ffn_hidden_size)"),
        (m.moe_shared_experts >= 0, f"model.moe_shared_experts={m.moe_shared_experts} must be >= 0"),
        (not m.moe_shared_expert_gate or m.moe_shared_experts > 0,
         f"model.moe_shared_expert_gate=true needs shared experts (model.moe_shared_experts={m.moe_shared_experts})"),
        (m.moe_layer_freq >= 1, f"model.moe_layer_freq={m.moe_layer_freq} must be >= 1"),
        (m.moe_bias_update_rate >= 0, f"model.moe_bias_update_rate={m.moe_bias_update_rate} must be >= 0"),
        (m.moe_aux_loss_coeff >= 0, f"model.moe_aux_loss_coeff={m.moe_aux_loss_coeff} must be >= 0"),
        (m.moe_z_loss_coeff >= 0, f"model.moe_z_loss_coeff={m.moe_z_loss_coeff} must be >= 0"),
        (m.moe_capacity_factor is None or m.moe_capacity_factor > 0,
         f"model.moe_capacity_factor={m.moe_capacity_factor} must be > 0 (or null: dropless)"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    width = m.moe_ffn_hidden_size or m.ffn_hidden_size
    etp = layout.expert_tp
    if etp > 1 and width % etp:
        raise ConfigError(f"the routed experts' width {width} (model.moe_ffn_hidden_size, null: ffn_hidden_size) is "
                          f"not divisible by the expert tensor-parallel size parallel.etp={etp}")
    if m.moe_shared_experts and (m.moe_shared_experts * width) % p.tp:
        raise ConfigError(f"the shared experts' width {m.moe_shared_experts * width} (model.moe_shared_experts="
                          f"{m.moe_shared_experts} x {width}) is not divisible by parallel.tp={p.tp}")
    local_seq = m.seq_length // p.cp
    if etp == 1 and p.tp > 1 and local_seq % p.tp:
        raise ConfigError(f"parallel.etp=1 splits each rank's {local_seq} tokens of a sample (model.seq_length="
                          f"{m.seq_length} / parallel.cp={p.cp}) over parallel.tp={p.tp}: not divisible")
    if p.ep > 1 and etp > 1 and m.arch == "gpt":  # fc2's bias is added after the tp sum, by global expert id
        raise ConfigError(f"parallel.ep={p.ep} with experts split over parallel.etp={etp} needs bias-free experts "
                          f"(model.arch=llama); model.arch={m.arch} has biases: set parallel.etp=1")


def validate_fault_keys(cfg) -> None:
    """The guards, watchdog, exits and retention of long runs."""
    t, c = cfg.train, cfg.checkpoint
    positive = [("train.max_skipped_steps", t.max_skipped_steps), ("train.spike_window", t.spike_window)]
    positive += [(k, v) for k, v in (("train.collective_timeout_s", t.collective_timeout_s),
                                      ("train.exit_duration_mins", t.exit_duration_mins),
                                      ("train.exit_interval", t.exit_interval),
                                      ("checkpoint.keep_last", c.keep_last),
                                      ("checkpoint.max_failed_saves", c.max_failed_saves),
                                      ("checkpoint.save_timeout_s", c.save_timeout_s)) if v is not None]
    for key, value in positive:
        if value <= 0:
            raise ConfigError(f"{key}={value} must be positive")
    if t.spike_factor <= 1.0:
        raise ConfigError(f"train.spike_factor={t.spike_factor} must be greater than 1")
    if t.straggler_ratio < 1.0:
        raise ConfigError(f"train.straggler_ratio={t.straggler_ratio} must be at least 1")
    if t.hang_report_ops < 0:
        raise ConfigError(f"train.hang_report_ops={t.hang_report_ops} must be >= 0")
    if t.max_rollbacks < 0:
        raise ConfigError(f"train.max_rollbacks={t.max_rollbacks} must be >= 0")
    if (not c.local_dir) != (c.local_interval <= 0) or c.local_interval < 0:
        raise ConfigError(f"checkpoint.local_dir={c.local_dir} and checkpoint.local_interval={c.local_interval}: the "
                          f"node-local tier needs both (a directory and an interval > 0), or neither")
    if c.local_dir and not c.save:
        raise ConfigError(f"checkpoint.local_dir={c.local_dir} is a fast copy of a run that also saves to the shared "
                          f"tier: set checkpoint.save (and checkpoint.load to the same directory to restart from either)")
    if t.spike_rollback and not (c.save and c.interval > 0):
        raise ConfigError(f"train.spike_rollback=true needs checkpoints to roll back to: checkpoint.save={c.save} "
                          f"and checkpoint.interval={c.interval} (must be > 0)")


def _validate_data_kind(cfg) -> None:
    """What the source of ``data.kind`` (its record in :data:`megand.data.source.DATA_KINDS`) needs."""
    d, kind = cfg.data, DATA_KINDS[cfg.data.kind]
    if kind.access == STREAM and not (d.paths and d.workers >= 0):
        raise ConfigError(f"data.kind={kind.name} needs data.paths (a list of [weight, {kind.paths}]) and "
                          f"data.workers >= 0: got data.paths={list(d.paths)}, data.workers={d.workers}")
    if kind.access == STREAM and cfg.train.eval_iters > 0 and not d.valid_paths:
        raise ConfigError(f"data.kind={kind.name} evaluates (train.eval_iters={cfg.train.eval_iters}) on a held-out "
                          f"stream: set data.valid_paths (files that data.paths does not hold), or train.eval_iters=0")
    if kind.paths and not d.paths:
        raise ConfigError(f"data.kind={kind.name} needs data.paths: a list of [weight, {kind.paths}]")


def _validate_tokenizer(data, vocab_size: int) -> None:
    from megand.data.tokenizer import TOKENIZER_TYPES

    if data.tokenizer_type is not None and data.tokenizer_type not in TOKENIZER_TYPES:
        raise ConfigError(f"data.tokenizer_type={data.tokenizer_type!r}: expected one of {', '.join(TOKENIZER_TYPES)} "
                          f"or null")
    if data.tokenizer_type is not None and not data.tokenizer:
        raise ConfigError(f"data.tokenizer_type={data.tokenizer_type} needs data.tokenizer (a tokenizer file)")
    if data.eod_id is not None and not 0 <= data.eod_id < vocab_size:
        raise ConfigError(f"data.eod_id={data.eod_id} is outside model.vocab_size={vocab_size}")


# (key, smallest allowed value): counts that would otherwise fail late (a ZeroDivisionError after step
# 1, a batch of negative size inside step 1) or silently (a run of "0 iterations" that exits 0)
MINIMUM = {"train.iters": 1, "train.micro_batch_size": 1, "train.global_batch_size": 1, "train.log_interval": 1,
           "train.eval_interval": 0, "train.eval_iters": 0, "optim.warmup_iters": 0, "checkpoint.interval": 0}


def check_recompute_layers(t, layers_per_stage) -> None:
    """``train.recompute_layers``: one count per (virtual) pipeline stage, within its layers, and a
    ``train.recompute`` for those layers to apply."""
    from megand.core.pipeline_parallel.layout import recomputed_layer_ids

    counts = t.get("recompute_layers")
    if counts is None:
        return
    counts = list(counts)
    if t.recompute == "none":
        raise ConfigError(f"train.recompute_layers={counts} says how many layers of each stage apply train.recompute, "
                          f"which is none: set train.recompute=full or selective (or train.recompute_layers=null)")
    recomputed_layer_ids(layers_per_stage, counts)


def check_counts(cfg) -> None:
    """Counts within their range and a readable ``data.split``; ConfigError naming the value."""
    from megand.data.builder import parse_split
    from megand.data.errors import DataError

    for key, low in MINIMUM.items():
        if _get(cfg, key) < low:
            raise ConfigError(f"{key}={_get(cfg, key)} must be >= {low}")
    if cfg.optim.decay_iters is not None and cfg.optim.decay_iters < 1:
        raise ConfigError(f"optim.decay_iters={cfg.optim.decay_iters} must be >= 1 (or null: train.iters)")
    check_optim(cfg.optim, cfg.optim.decay_iters or cfg.train.iters, cfg.train.iters)
    try:
        train_fraction = parse_split(cfg.data.split)[0]
    except DataError as e:
        raise ConfigError(str(e)) from None
    if train_fraction == 0 and cfg.data.kind != "mock":
        raise ConfigError(f"data.split={cfg.data.split!r} gives the train split no documents")


def check_optim(o, decay_iters: int, iters: int) -> None:
    """Every optimizer and schedule value (signs, orders, ranges; the optimizer's own in its record)."""
    from megand.core.optimizer.registry import check_values

    try:
        check_values(o, decay_iters, iters)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def compose(overrides=(), config_dir: str | None = None):
    """The composed run config, as ``pretrain_gpt.py`` would see it (for tools and tests)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_schema()
    config_dir = config_dir or CONF_DIR
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def transformer_config(cfg):
    """The model's shape from ``model``, plus the runtime choices of ``parallel`` and ``train``."""
    from megand.core.transformer import TransformerConfig

    model = OmegaConf.to_container(cfg.model, resolve=True)
    etp = cfg.parallel.tp if cfg.parallel.etp is None else cfg.parallel.etp
    try:  # every model key is core's: one the core config does not declare is refused, never dropped
        return TransformerConfig.from_model(model, sequence_parallel=bool(cfg.parallel.sequence_parallel),
                                            cp_comm=cfg.parallel.cp_comm, recompute=cfg.train.recompute,
                                            precision=cfg.train.precision, expert_tensor_parallel=etp == cfg.parallel.tp)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def collective_timeout_s(cfg, device) -> float:
    """How long a rank may wait in one phase of a step (the hang watchdog) and in one collective (the
    process groups' timeout): ``train.collective_timeout_s``, or 600 s on GPU, 1800 s on CPU."""
    if cfg.train.collective_timeout_s is not None:
        return float(cfg.train.collective_timeout_s)
    return 600.0 if device.type == "cuda" else 1800.0


# The process groups' own timeout comes this much after the watchdog's: the watchdog, which prints where
# each rank is, reports a hang first; the backend's abort (NCCL's watchdog, gloo's timeout) is the backstop.
BACKEND_TIMEOUT_GRACE_S = 60.0


def backend_timeout_s(budget_s: float) -> float:
    """The process-group timeout for collectives whose watchdog budget is ``budget_s``."""
    return budget_s + BACKEND_TIMEOUT_GRACE_S


def save_timeout_s(cfg) -> float:
    """The budget of one checkpoint save or load, which may take far longer than a step's collective (a
    large model on a slow filesystem): ``checkpoint.save_timeout_s``, or the larger of an hour and
    ``train.collective_timeout_s``."""
    if cfg.checkpoint.save_timeout_s is not None:
        return float(cfg.checkpoint.save_timeout_s)
    return max(3600.0, float(cfg.train.collective_timeout_s or 0.0))
