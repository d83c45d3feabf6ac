"""Hugging Face weight files, one tensor at a time: lazy reading of ``model.safetensors`` or of shards listed
in ``model.safetensors.index.json``, and writing shards of bounded size plus the index.

Reading opens a shard only for the tensor asked for and closes it again, so the process never keeps a
whole memory-mapped shard resident; writing holds at most one shard's tensors before it is flushed.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def parse_size(text: str | int) -> int:
    """Bytes in ``"500MB"``, ``"5GB"``, ``"2GiB"`` or a plain integer."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not match:
        raise ValueError(f"--max-shard-size={text!r}: expected bytes or a size such as 500MB, 5GB")
    number, unit = float(match.group(1)), match.group(2).rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    if number * scale < 1:
        raise ValueError(f"--max-shard-size={text!r}: must be at least one byte")
    return int(number * scale)


class SafetensorsReader:
    """The tensors of a transformers directory, by name, read only when asked for."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.file_of = dict(json.load(f)["weight_map"])
        elif os.path.isfile(os.path.join(directory, SINGLE)):
            with safe_open(os.path.join(directory, SINGLE), "pt") as f:
                self.file_of = {name: SINGLE for name in f.keys()}
        else:
            raise FileNotFoundError(f"{directory}: neither {SINGLE} nor {INDEX} (only safetensors weights are read)")
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for file in sorted(set(self.file_of.values())):
            path = os.path.join(directory, file)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: listed in {INDEX} but missing")
            with safe_open(path, "pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    self._meta[name] = (tuple(piece.get_shape()), piece.get_dtype())

    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        code = self._meta[name][1]
        if code not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {code} is not supported (expected one of {sorted(DTYPES)})")
        return DTYPES[code]

    def get(self, name: str) -> torch.Tensor:
        with safe_open(os.path.join(self.directory, self.file_of[name]), "pt") as f:
            return f.get_tensor(name)


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a storage of its own (safetensors refuses views sharing memory)."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)


class ShardWriter:
    """Writes tensors into ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` (a
    larger tensor gets a shard of its own) and the index; a single shard is ``model.safetensors``."""

    def __init__(self, directory: str, max_shard_bytes: int):
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        os.makedirs(directory, exist_ok=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # tensor names per written shard
        self.total_bytes = 0

    def _tmp_name(self, i: int) -> str:
        return os.path.join(self.directory, f"model-{i + 1:05d}.safetensors.tmp")

    def _flush(self) -> None:
        if self.pending:
            save_file(self.pending, self._tmp_name(len(self.shards)), metadata={"format": "pt"})
            self.shards.append(list(self.pending))
            self.pending, self.pending_bytes = {}, 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.pending and self.pending_bytes + tensor.nbytes > self.max_shard_bytes:
            self._flush()
        self.pending[name] = _own(tensor)
        self.pending_bytes += tensor.nbytes
        self.total_bytes += tensor.nbytes

    def close(self) -> list[str]:
        """Flush, give the shards their final names, write the index (several shards); returns the files."""
        self._flush()
        n = len(self.shards)
        if n == 1:
            os.replace(self._tmp_name(0), os.path.join(self.directory, SINGLE))
            return [SINGLE]
        names, weight_map = [], {}
        for i, tensors in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self._tmp_name(i), os.path.join(self.directory, name))
            names.append(name)
            weight_map.update({t: name for t in tensors})
        with open(os.path.join(self.directory, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        return names + [INDEX]
