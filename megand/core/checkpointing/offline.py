"""One-process access to checkpoint files, for tools (conversion, generation, benchmarks).

Full tensors are read with plain ``torch.distributed.checkpoint.load`` into full-size tensors (``no_dist``):
DCP assembles each from the pieces any layout wrote, and loads only the keys asked for, so a tool can
read a large model one tensor at a time. Writing a model from full tensors is the same in reverse: a full
tensor is one piece at offset zero, which any layout can later load. :func:`save_model_streaming` writes
one file per tensor and asks for each tensor only when its file is written, so a model larger than
memory can be written tensor by tensor.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

from megand.core.checkpointing import files


@contextlib.contextmanager
def _one_process():
    """DCP warns on every call made without a process group; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def tensor_shapes(path: str, prefix: str = "model.") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(full shape, dtype) of every tensor under ``prefix`` of the checkpoint at ``path``, keyed without the
    prefix; reads the metadata and checks the data files (sizes, checksums) without loading tensors."""
    iter_dir = files.resolve(path)
    metadata = files.read_metadata(iter_dir)
    files.check_files(iter_dir, metadata)
    return tensor_shapes_of(metadata, prefix)


def tensor_shapes_of(metadata, prefix: str = "model.") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """:func:`tensor_shapes` from a checkpoint's metadata already read."""
    return {k[len(prefix):]: (tuple(md.size), md.properties.dtype) for k, md in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}


def load_tensors(path: str, names, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Only the tensors ``names`` (without ``prefix``) of the checkpoint at ``path``, full size, in their
    stored dtype."""
    iter_dir = files.resolve(path)
    metadata = files.read_metadata(iter_dir)
    state = {}
    for name in names:
        md = metadata.state_dict_metadata.get(prefix + name)
        if not isinstance(md, TensorStorageMetadata):
            raise files.CheckpointError(f"tensor {name} is missing from the checkpoint {iter_dir}")
        state[prefix + name] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with _one_process():
        dcp.load(state, checkpoint_id=iter_dir, no_dist=True)
    return {k[len(prefix):]: v for k, v in state.items()}


def load_full_tensors(path: str, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` of the checkpoint at ``path`` (save dir or iteration dir), full size,
    keyed without the prefix."""
    iter_dir = files.resolve(path)
    metadata = files.read_metadata(iter_dir)
    files.check_files(iter_dir, metadata)
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for k, md in metadata.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    with _one_process():
        dcp.load(state, checkpoint_id=iter_dir, no_dist=True)
    return {k[len(prefix):]: v for k, v in state.items()}


class _LazySavePlanner(DefaultSavePlanner):
    """Plans from shape-only (meta) tensors and asks ``produce(key)`` for each tensor's data only when its
    file is written: with one file per tensor, one tensor is in memory at a time."""

    def __init__(self, produce):
        super().__init__()
        self.produce = produce

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        return self.produce(write_item.index.fqn).contiguous()


def save_model_streaming(save_dir: str, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], produce,
                         config_yaml: str, model_cfg: dict, iteration: int = 0) -> str:
    """Write a model-only megand checkpoint (no optimizer state: training starting from it begins with a
    fresh optimizer at ``iteration``) of the tensors ``shapes`` (name -> (full shape, dtype)), calling
    ``produce(name)`` for each tensor's data only when it is written; returns the iteration directory."""
    os.makedirs(save_dir, exist_ok=True)
    final = os.path.join(save_dir, files.iter_dir_name(iteration))
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    def produce_checked(key):
        name = key[len("model."):]
        tensor = produce(name)
        shape, dtype = shapes[name]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise files.CheckpointError(f"tensor {name}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                                        f"expected {tuple(shape)} {dtype}")
        return tensor

    layout = {f"model.{k}": torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in shapes.items()}
    with _one_process():
        dcp.save(layout, storage_writer=FileSystemWriter(tmp, single_file_per_rank=False),
                 planner=_LazySavePlanner(produce_checked), no_dist=True)
    torch.save({"format": files.FORMAT, "iteration": iteration, "consumed_samples": 0, "global_batch_size": None,
                "optimizer": None, "run_id": None, "layout": None, "model": model_cfg}, os.path.join(tmp, files.COMMON))
    with open(os.path.join(tmp, "config.yaml"), "w") as f:
        f.write(config_yaml)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    files.atomic_write_text(os.path.join(save_dir, files.LATEST), f"{iteration}\n")
    return final


def save_full_model(save_dir: str, tensors: dict[str, torch.Tensor], config_yaml: str, model_cfg: dict,
                    iteration: int = 0) -> str:
    """:func:`save_model_streaming` of tensors already in memory."""
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    return save_model_streaming(save_dir, shapes, tensors.__getitem__, config_yaml, model_cfg, iteration)


def single_process_topology(device=None):
    """A world of one (gloo), for building a full model in a tool or test process."""
    from megand.core.parallel_layout import ParallelLayout
    from megand.core.parallel_state import Topology

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return Topology(ParallelLayout(), device=device or torch.device("cpu"))
