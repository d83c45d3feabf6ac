"""The planner's prediction for a run config as ``pretrain_gpt.py`` would run it (the calibration's
overhead fit and the accuracy benchmarks compare it with measured steps)."""

from __future__ import annotations


def candidate_of(cfg, world: int):
    """The planner's Candidate for a composed run config on ``world`` ranks."""
    from megand.tools.planner.layout import PLANNED_KEYS, Candidate, planned_layout

    p, t, o = cfg.parallel, cfg.train, cfg.optim
    keys = tuple(k for k in PLANNED_KEYS if k != "pp_schedule")  # the default schedule, as calibrated
    return Candidate(parallel=planned_layout(p, world, keys),
                     sequence_parallel=bool(p.sequence_parallel), sharding=o.sharding,
                     micro_batch_size=t.micro_batch_size, recompute=t.recompute, cp_comm=p.cp_comm,
                     recompute_layers=tuple(t.recompute_layers) if t.get("recompute_layers") is not None else None,
                     precision=t.precision,
                     pipeline_layout=tuple(p.pipeline_layout) if p.pipeline_layout is not None else None,
                     overlap_grad_reduce=bool(o.overlap_grad_reduce), overlap_param_gather=bool(o.overlap_param_gather),
                     reshard_after_forward=bool(o.reshard_after_forward), bucket_size=int(o.bucket_size))


def predict_config(cfg, world: int, stage_groups):
    """The planner's Prediction for composed config ``cfg`` with pipeline stage r on ``stage_groups[r]``."""
    from omegaconf import OmegaConf

    from megand.tools.planner.cost import predict

    model = OmegaConf.to_container(cfg.model, resolve=True)
    return predict(model, candidate_of(cfg, world), int(cfg.train.global_batch_size), stage_groups)


def one_device_group(profile, name: str = "device", memory_gib: float = 1024.0):
    """A cluster group of one device of ``profile`` (memory large: only times are wanted)."""
    from megand.tools.planner.cluster import Group

    return Group(name=name, nodes=1, devices_per_node=1, memory_gib=memory_gib, profile=profile)
