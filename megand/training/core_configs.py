"""The run's Hydra config turned into core's typed configs, once, at start-up.

:func:`core_configs` reads the validated config and returns :class:`CoreConfigs`; every builder of the
start-up (topology, datasets, model, data-parallel engine, optimizer, checkpointer) takes its piece of it
and never the Hydra config::

    cfg --validate--> core_configs(cfg, device, world_size) --> CoreConfigs
        .layout, .collective_timeout_s -> Topology           (build_topology)
        .datasets       -> the train/valid datasets         (build_datasets)
        .model, .pipeline, .fp8, .seed -> the model chunks (build_model)
        .data_parallel  -> DataParallel                     (build_model_and_engine)
        .optimizer      -> Optimizer
        .checkpoint     -> Checkpointer
        .documents      -> the batches' document masks

Every key of the ``parallel``, ``optim`` and ``checkpoint`` sections goes into a core config by name or is
listed in :data:`READ_ELSEWHERE` with what reads it: a key that is neither is an error naming it, never
dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Any

from omegaconf import OmegaConf

from megand.core.checkpointing.config import CheckpointConfig
from megand.core.distributed.config import DataParallelConfig
from megand.core.optimizer.config import OptimizerConfig
from megand.core.parallel_layout import ParallelLayout
from megand.core.pipeline_parallel.layout import PipelinePlan, pipeline_layout, recomputed_layer_ids
from megand.core.tensor_parallel.fp8 import Fp8Config
from megand.core.transformer import TransformerConfig
from megand.training.batches import DocumentFlags
from megand.training.config import (
    ConfigError,
    backend_timeout_s,
    collective_timeout_s,
    save_timeout_s,
    transformer_config,
)

# Keys of these sections that are not taken by name into the section's core configs, and what reads them
# instead (another core config, the training loop, the validation). A key of these sections that is
# neither a field of the section's core configs nor listed here is refused.
READ_ELSEWHERE = {
    "optim": {
        "distributed": "removed key: validate() refuses it, naming optim.sharding",
    },
    "checkpoint": {
        "load": "the Trainer's resume (megand.training.resume.load_path)",
        "interval": "the Trainer's checkpoint step",
        "continue_on_error": "the Trainer's checkpoint step (SaveFailures)",
        "max_failed_saves": "the Trainer's checkpoint step (SaveFailures)",
        "local_interval": "the Trainer's checkpoint step (local tier)",
        "save_timeout_s": "CheckpointConfig.budget_s, .timeout_s (with the backend's grace) and the hang watchdog",
    },
    "parallel": {
        "sequence_parallel": "TransformerConfig.sequence_parallel",
        "cp_comm": "TransformerConfig.cp_comm",
        "pipeline_layout": "PipelinePlan.layers_per_stage (and ParallelLayout.stage_tp, .stage_sp of its per-stage form)",
    },
}


@dataclass(frozen=True)
class DatasetPlan:
    """What the datasets are built from: the ``data`` section (a plain dict, the data package's input), the
    sample shape, the seed and how many samples each split must provide."""

    data: dict
    seq_length: int
    vocab_size: int
    seed: int
    train_samples: int
    valid_samples: int


@dataclass(frozen=True)
class CoreConfigs:
    """Every typed config the start-up builds from; see the module docstring for which builder takes what."""

    model: TransformerConfig
    layout: ParallelLayout  # the parallel sizes and options on the run's world size
    pipeline: PipelinePlan
    fp8: Fp8Config | None  # None: no FP8 GEMMs
    seed: int  # initialisation (per parameter name) and the random streams
    optimizer: OptimizerConfig
    data_parallel: DataParallelConfig
    checkpoint: CheckpointConfig
    datasets: DatasetPlan
    documents: DocumentFlags | None  # None: no document masks, positions or loss masks
    collective_timeout_s: float  # the hang watchdog's budget for one phase of a step
    save_timeout_s: float  # its budget for one checkpoint save or load


def split_section(section: str, values: dict[str, Any], *targets: type) -> list[dict[str, Any]]:
    """``values`` (one config section) split among the core config types ``targets`` by their field names; a
    key that no target declares and that :data:`READ_ELSEWHERE` does not list is a ConfigError naming it."""
    names = [{f.name for f in dataclass_fields(t)} for t in targets]
    unread = sorted(k for k in values if k not in READ_ELSEWHERE.get(section, {}) and not any(k in n for n in names))
    if unread:
        raise ConfigError(f"{', '.join(section + '.' + k for k in unread)}: read by no core config "
                          f"({', '.join(t.__name__ for t in targets)}) and not listed in READ_ELSEWHERE")
    return [{k: v for k, v in values.items() if k in n} for n in names]


def _section(cfg, name: str) -> dict[str, Any]:
    return OmegaConf.to_container(cfg[name], resolve=True)


def parallel_layout(cfg, world_size: int) -> ParallelLayout:
    """The ``parallel`` section on ``world_size`` ranks (``parallel.dp`` null: what the world leaves)."""
    section = _section(cfg, "parallel")
    (keys,) = split_section("parallel", section, ParallelLayout)
    # the per-stage widths of a per-stage pipeline_layout (its tp and sp default to parallel.tp, .sequence_parallel)
    stages = {k: section.get(k) for k in ("pipeline_layout", "sequence_parallel")}
    return ParallelLayout.from_keys({**keys, **stages}, world_size)


def pipeline_plan(cfg) -> PipelinePlan:
    """The layers of each (virtual) pipeline stage and those that apply ``train.recompute``
    (``train.recompute_layers``' first layers of each stage; null: every layer)."""
    p = cfg.parallel
    layers = pipeline_layout(cfg.model.num_layers, p.pp, p.vpp, p.pipeline_layout)
    counts = cfg.train.get("recompute_layers")
    return PipelinePlan(tuple(layers), recomputed_layer_ids(layers, None if counts is None else list(counts)))


def fp8_config(cfg) -> Fp8Config | None:
    t = cfg.train
    return Fp8Config(t.fp8, t.fp8_bf16_layers) if t.get("fp8") else None


def optimizer_and_data_parallel_configs(cfg) -> tuple[OptimizerConfig, DataParallelConfig]:
    """The ``optim`` section's two readers: the optimizer and the data-parallel engine (sharding, buckets)."""
    optim = _section(cfg, "optim")
    optim["decay_iters"] = optim.get("decay_iters") or cfg.train.iters
    optimizer_keys, engine_keys = split_section("optim", optim, OptimizerConfig, DataParallelConfig)
    # compiled layers read their weights' FP8 operands by quantising the gathered bf16 weight
    engine_keys["fp8_param_gather"] = not cfg.train.get("compile", False)
    return OptimizerConfig(**optimizer_keys), DataParallelConfig(**engine_keys)


def checkpoint_config(cfg) -> CheckpointConfig:
    (keys,) = split_section("checkpoint", _section(cfg, "checkpoint"), CheckpointConfig)
    return CheckpointConfig(**keys, timeout_s=backend_timeout_s(save_timeout_s(cfg)), budget_s=save_timeout_s(cfg))


def dataset_plan(cfg) -> DatasetPlan:
    t, m = cfg.train, cfg.model
    return DatasetPlan(_section(cfg, "data"), m.seq_length, m.vocab_size, t.seed,
                       train_samples=t.iters * t.global_batch_size, valid_samples=t.eval_iters * t.global_batch_size)


def document_flags(cfg) -> DocumentFlags | None:
    """``data.reset_attention_mask`` / ``reset_position_ids`` / ``eod_mask_loss`` with the data's EOD id,
    or None when all three are off."""
    d = cfg.data
    if not (d.reset_attention_mask or d.reset_position_ids or d.eod_mask_loss):
        return None
    from megand.data.builder import eod_token_id

    return DocumentFlags(eod_token_id(_section(cfg, "data"), cfg.model.vocab_size),
                         bool(d.reset_attention_mask), bool(d.reset_position_ids), bool(d.eod_mask_loss))


def core_configs(cfg, device, world_size: int) -> CoreConfigs:
    """The validated run config ``cfg`` as core's typed configs, for a run of ``world_size`` ranks on
    ``device`` (its type sets the default timeouts). Called once per start-up; the builders take only its
    pieces."""
    optimizer, data_parallel = optimizer_and_data_parallel_configs(cfg)
    return CoreConfigs(
        model=transformer_config(cfg),
        layout=parallel_layout(cfg, world_size),
        pipeline=pipeline_plan(cfg),
        fp8=fp8_config(cfg),
        seed=int(cfg.train.seed),
        optimizer=optimizer,
        data_parallel=data_parallel,
        checkpoint=checkpoint_config(cfg),
        datasets=dataset_plan(cfg),
        documents=document_flags(cfg),
        collective_timeout_s=collective_timeout_s(cfg, device),
        save_timeout_s=save_timeout_s(cfg),
    )
