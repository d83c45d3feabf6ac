"""One-process access to checkpoint files, for tools (conversion, generation, benchmarks).

Full tensors are read with plain ``torch.distributed.checkpoint.load`` into full-size tensors (``no_dist``):
DCP assembles each from the pieces any layout wrote. Writing a model from full tensors is the same in
reverse: a full tensor is one piece at offset zero, which any layout can later load.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megand.core.checkpointing import files


def load_full_tensors(path: str, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` of the checkpoint at ``path`` (save dir or iteration dir), full size,
    keyed without the prefix."""
    iter_dir = files.resolve(path)
    metadata = files.read_metadata(iter_dir)
    files.check_files(iter_dir, metadata)
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for k, md in metadata.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=iter_dir, no_dist=True)
    return {k[len(prefix):]: v for k, v in state.items()}


def save_full_model(save_dir: str, tensors: dict[str, torch.Tensor], config_yaml: str, model_cfg: dict,
                    iteration: int = 0) -> str:
    """Write a model-only megand checkpoint (no optimizer state: training starting from it begins with a
    fresh optimizer at ``iteration``) from full tensors; returns the iteration directory."""
    os.makedirs(save_dir, exist_ok=True)
    final = os.path.join(save_dir, files.iter_dir_name(iteration))
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    dcp.save({f"model.{k}": v.contiguous() for k, v in tensors.items()}, checkpoint_id=tmp, no_dist=True)
    torch.save({"format": files.FORMAT, "iteration": iteration, "consumed_samples": 0, "global_batch_size": None,
                "optimizer": None, "run_id": None, "layout": None, "model": model_cfg}, os.path.join(tmp, files.COMMON))
    with open(os.path.join(tmp, "config.yaml"), "w") as f:
        f.write(config_yaml)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    files.atomic_write_text(os.path.join(save_dir, files.LATEST), f"{iteration}\n")
    return final


def single_process_topology(device=None):
    """A world of one (gloo), for building a full model in a tool or test process."""
    from megand.core.parallel_state import ParallelSizes, Topology

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return Topology(ParallelSizes(), device=device or torch.device("cpu"))
