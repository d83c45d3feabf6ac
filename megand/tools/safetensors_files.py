"""Hugging Face weight files, one tensor at a time: lazy reading of ``model.safetensors`` or of shards listed
in ``model.safetensors.index.json``, and writing shards of bounded size plus the index.

Reading opens a shard only for the tensor asked for and closes it again, so the process never keeps a
whole memory-mapped shard resident; writing streams each tensor to its shard as it comes.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import SafetensorError, safe_open

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
FP8 = torch.float8_e4m3fn  # DeepSeek-V3's published weights: e4m3 with a float32 scale per weight block
READ_ONLY_DTYPES = {"F8_E4M3": FP8}  # read (and dequantized on import), never written


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


def _open(path: str):
    """``safe_open``, with a file that is not a whole safetensors file (truncated, or another format) as one
    ValueError naming it."""
    try:
        return safe_open(path, "pt")
    except SafetensorError as e:
        raise ValueError(f"{path}: not a complete safetensors file ({' '.join(str(e).split())}): truncated or "
                         f"damaged in transfer? download it again") from None


class SafetensorsReader:
    """The tensors of a transformers directory, by name, read only when asked for."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.file_of = dict(json.load(f)["weight_map"])
        elif os.path.isfile(os.path.join(directory, SINGLE)):
            with _open(os.path.join(directory, SINGLE)) as f:
                self.file_of = {name: SINGLE for name in f.keys()}
        else:
            raise FileNotFoundError(f"{directory}: neither {SINGLE} nor {INDEX} (only safetensors weights are read)")
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for file in sorted(set(self.file_of.values())):
            path = os.path.join(directory, file)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: listed in {INDEX} but missing")
            with _open(path) as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    self._meta[name] = (tuple(piece.get_shape()), piece.get_dtype())

    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        code = self._meta[name][1]
        known = {**DTYPES, **READ_ONLY_DTYPES}
        if code not in known:
            raise ValueError(f"tensor {name}: dtype {code} is not supported (expected one of {sorted(known)})")
        return known[code]

    def get(self, name: str) -> torch.Tensor:
        with _open(os.path.join(self.directory, self.file_of[name])) as f:
            return f.get_tensor(name)


NAMES_OF = {dtype: code for code, dtype in DTYPES.items()}


class ShardWriter:
    """Writes tensors, in the order they were announced, into ``model-0000i-of-0000n.safetensors`` shards of
    at most ``max_shard_bytes`` (a larger tensor gets a shard of its own) plus the index; a single shard is
    ``model.safetensors``. Every name, shape and dtype is known up front, so each shard's header is
    written first and each tensor goes to disk as soon as it is added: nothing is buffered."""

    def __init__(self, directory: str, entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int):
        self.directory = directory
        self.shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for name, shape, dtype in entries:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if self.shards[-1] and size + nbytes > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append((name, tuple(shape), dtype))
            size += nbytes
        n = len(self.shards)
        self.names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.order = [(i, entry) for i, shard in enumerate(self.shards) for entry in shard]
        self.next = 0
        self.file = None
        self.total_bytes = sum(torch.Size(s).numel() * d.itemsize for _, s, d in entries)
        os.makedirs(directory, exist_ok=True)

    def _open(self, i: int) -> None:
        header, offset = {}, 0
        for name, shape, dtype in self.shards[i]:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": NAMES_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.file = open(os.path.join(self.directory, self.names[i] + ".tmp"), "wb")
        self.file.write(len(text).to_bytes(8, "little"))
        self.file.write(text)

    def _close(self, i: int) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.file = None
        os.replace(os.path.join(self.directory, self.names[i] + ".tmp"), os.path.join(self.directory, self.names[i]))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        i, (expected, shape, dtype) = self.order[self.next]
        if name != expected or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype}: expected {expected} {shape} {dtype}")
        if self.file is None:
            self._open(i)
        self.file.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)
        self.next += 1
        if self.next == len(self.order) or self.order[self.next][0] != i:
            self._close(i)

    def close(self) -> list[str]:
        """Write the index (several shards); returns the files written."""
        if self.next != len(self.order):
            raise ValueError(f"{len(self.order) - self.next} announced tensors were not written, "
                             f"the first {self.order[self.next][1][0]}")
        if len(self.names) == 1:
            return list(self.names)
        weight_map = {name: self.names[i] for i, (name, _, _) in self.order}
        with open(os.path.join(self.directory, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        return self.names + [INDEX]


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek's block-scaled FP8 weight ``[rows, cols]`` in fp32: each ``block`` tile (the last ones cut at the
    edges) times its entry of ``scale_inv [ceil(rows / block[0]), ceil(cols / block[1])]``."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale
