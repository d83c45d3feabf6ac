"""Each rank's random streams in a checkpoint: plain tensors and numbers, loadable without unpickling code.

A checkpoint may come from someone else, so nothing in it is read with ``torch.load(weights_only=False)``
(which runs whatever a pickle names). The RNG file holds only dicts, lists, ints, floats, strings and
CPU tensors, and is read with ``weights_only=True``: a file holding anything else (a crafted pickle, or an
RNG file of a megand from before this format, which pickled numpy's state) is refused with a
:class:`CheckpointError` naming it, before any of it runs.

The file also records the device kind that wrote it. The CPU-side streams (Python, numpy, torch's CPU
generator) are restored on any device. The device-side ones (the CUDA default generator and the
tensor-parallel stream, whose state is a CUDA generator's on a GPU and a CPU generator's on a CPU) are
restored only on the same kind of device: a checkpoint moved between a CPU and a GPU keeps the streams
seeded from ``train.seed`` at start-up instead, and :func:`restore` says so.
"""

from __future__ import annotations

import pickle
import random
import re

import numpy as np
import torch

from megand.core.checkpointing.errors import CheckpointError

FORMAT = 2  # 1: a pickle of Python and numpy objects (read only by trusting the file)


def tp_rngs(chunks):
    """The model-parallel RNG streams used by the chunks (one object shared by all, in practice)."""
    from megand.core.tensor_parallel import TensorParallelRNG

    seen = {}
    for chunk in chunks:
        for module in chunk.modules():
            rng = getattr(module, "rng", None)
            if isinstance(rng, TensorParallelRNG):
                seen[id(rng)] = rng
    return list(seen.values())


def capture(rngs, device: torch.device) -> dict:
    """This rank's random streams as tensors and numbers (see the module docstring)."""
    version, words, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "format": FORMAT,
        "device": device.type,
        "python": {"version": int(version), "state": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": str(kind), "key": torch.from_numpy(np.asarray(key, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(cached)},
        "torch": torch.get_rng_state(),
        "tp": [r.state.clone().cpu() for r in rngs],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def read(path: str) -> dict:
    """The RNG file at ``path``, loaded without running any code it may hold; CheckpointError otherwise."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        # torch's message is a page of advice (including to unpickle anyway); keep the line naming the object
        found = re.search(r"Unsupported global: GLOBAL [\w.]+|Unsupported operand \d+", str(e))
        first = found.group(0) if found else type(e).__name__
        raise CheckpointError(
            f"{path}: refused to load: it holds Python objects beyond plain tensors and numbers, which could run "
            f"code when unpickled: a crafted file, or one written by an older megand (if you trust this checkpoint: "
            f"python tools/convert_checkpoint.py upgrade-rng --load DIR); {first})") from None
    except (OSError, EOFError, RuntimeError) as e:
        raise CheckpointError(f"{path}: corrupted ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path}: unknown RNG file format {found!r} (expected {FORMAT})")
    return state


def restore(state: dict, rngs, device: torch.device) -> str | None:
    """Set this rank's streams from ``state`` (:func:`read`). None when every stream was restored; else a
    notice naming what was re-seeded instead (a checkpoint written on another kind of device)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    saved_on = state["device"]
    if saved_on != device.type:
        # a CUDA generator's state (seed and offset) and a CPU generator's (Mersenne Twister) do not
        # convert into each other: the device streams keep their start-up seeding from train.seed
        return (f"written on {saved_on}, resumed on {device.type}: the device's default and tensor-parallel random "
                f"streams are re-seeded from train.seed (dropout masks differ from an uninterrupted run; the "
                f"CPU-side streams are restored)")
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    for r, s in zip(rngs, state["tp"]):
        r.state = s
    return None


def from_format1(old: dict) -> dict:
    """A format-1 RNG state (Python's and numpy's state objects as pickled) in this module's format; the
    device kind is inferred: format 1 held a ``cuda`` entry exactly when written on a GPU."""
    version, words, gauss = old["python"]
    kind, key, pos, has_gauss, cached = old["numpy"]
    return {"format": FORMAT, "device": "cuda" if "cuda" in old else "cpu",
            "python": {"version": int(version), "state": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
            "numpy": {"kind": str(kind), "key": torch.from_numpy(np.asarray(key, dtype=np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(cached)},
            "torch": old["torch"], "tp": [s.clone().cpu() for s in old["tp"]],
            **({"cuda": old["cuda"]} if "cuda" in old else {})}
