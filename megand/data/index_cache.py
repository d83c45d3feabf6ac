"""Cache of numpy index arrays on disk, keyed by a hash of everything that determines them."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

import numpy as np


def description_hash(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]


def load_or_build(cache_dir: str | None, tag: str, description: dict,
                  build: Callable[[], dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], bool]:
    """Return ``(arrays, built)``: the cached arrays (memory-mapped) or freshly built and saved ones.

    Several ranks may call this at once: each file is written under a private name and renamed into
    place, so a reader never sees a partial file (at worst two ranks build the same arrays).
    """
    if cache_dir is None:
        return build(), True
    stem = os.path.join(str(cache_dir), f"{tag}-{description_hash(description)}")
    listing = stem + "-description.json"
    if os.path.exists(listing):  # written last: its presence means every array is complete
        with open(listing) as f:
            names = json.load(f)["arrays"]
        return {n: np.load(f"{stem}-{n}.npy", mmap_mode="r") for n in names}, False
    arrays = build()
    os.makedirs(cache_dir, exist_ok=True)
    for name, array in arrays.items():
        _atomic_write(f"{stem}-{name}.npy", lambda f, a=array: np.save(f, a))
    text = json.dumps({**description, "arrays": sorted(arrays)}, indent=1, sort_keys=True)
    _atomic_write(listing, lambda f: f.write(text.encode()))
    return arrays, True


def _atomic_write(path: str, write: Callable) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)
