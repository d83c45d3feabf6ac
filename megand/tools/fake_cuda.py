"""Stand-ins for the CUDA runtime, so that a CPU-only torch build runs a training step on fake CUDA tensors.

``FakeTensorMode`` creates fake ``cuda`` tensors on any build and runs the meta kernels of the CUDA
operations (flash attention, ``torch._grouped_mm``, ``mm`` with ``out_dtype``...). What a CPU-only build
lacks is the runtime around them: autograd asks the device's guard for its current stream, and the
engine asks ATen's CUDA hooks whether CUDA is the accelerator. Two tiny C++ registrations supply them
(a no-op CUDA device guard, torch's own ``FakeGuardImpl``; CUDA hooks that say "8 devices, available"):
they are compiled once with the system's C++ compiler against the installed torch's headers, cached,
and loaded into a fresh process before torch initialises its hooks (``run_child``). ATen caches its
hooks at first use, so the loading process cannot be one that has already imported torch. A CUDA build
of torch is refused in one line (:func:`refusal`, read from its ``version.py`` without importing it): its
``libtorch_cuda`` registers the CUDA hooks too, and c10 ends a process that registers them twice.

The Python side of the runtime (``torch.cuda.*``: device queries, streams, events, memory statistics,
the CUDA random generator, ``synchronize``) is patched by :class:`CudaRuntime`, only while a rehearsal
runs, and reports its synchronisations to the rehearsal's counter. Nothing here is imported by the
training code: the rehearsal supplies it from outside, as it supplies the fake process group.

Private torch APIs used: the C++ registries ``C10_REGISTER_GUARD_IMPL`` and ``CUDAHooksRegistry``
(header-only, no public Python equivalent in torch 2.13).
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile

SOURCE = r"""
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
namespace at {
// CUDA is the accelerator, with 8 devices; nothing else of the runtime is provided (no allocator, no
// generator): fake tensors never allocate, and the rehearsal supplies the rest from Python.
struct RehearsalCUDAHooks : CUDAHooksInterface {
  RehearsalCUDAHooks(CUDAHooksArgs) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  int getNumGPUs() const override { return 8; }
  DeviceIndex deviceCount() const override { return 8; }
  DeviceIndex current_device() const override { return 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
};
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, RehearsalCUDAHooks)
}  // namespace at
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
extern "C" int rehearsal_cuda_runtime_loaded() { return 1; }
"""

LOADED = False  # set in the child once the library is loaded (before torch)


class RuntimeUnavailable(RuntimeError):
    """The stand-in runtime cannot be built or loaded (no C++ compiler, no torch headers, a CUDA build)."""


def _torch_dir() -> str:
    spec = importlib.util.find_spec("torch")  # without importing torch (the child must load us first)
    return os.path.dirname(spec.origin)


def torch_cuda_version(torch_dir: str | None = None) -> str | None:
    """The CUDA version the installed torch is built for (``torch.version.cuda``; None on a CPU build),
    read from its ``version.py`` without importing torch."""
    with open(os.path.join(torch_dir or _torch_dir(), "version.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "cuda" and isinstance(node.value, ast.Constant):
            return node.value.value
    return None


def refusal(torch_dir: str | None = None) -> str | None:
    """Why the stand-in runtime cannot load with this torch (None: it can). On a CUDA build libtorch_cuda
    registers the same CUDA hooks as the stand-in, and a second registration ends the process."""
    version = torch_cuda_version(torch_dir)
    if version is None:
        return None
    return (f"the CUDA rehearsal runs on a CPU build of torch; this one is built for CUDA {version} (its CUDA "
            f"hooks and the rehearsal's cannot both be registered): rehearse on a CPU machine, check this one "
            f"with tools/gpu_check.py")


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megand")


def library_path() -> str:
    """The compiled stand-in library for the installed torch, built on first use (about a second)."""
    torch_dir = _torch_dir()
    refused = refusal(torch_dir)
    if refused:
        raise RuntimeUnavailable(refused)
    with open(os.path.join(torch_dir, "version.py")) as f:
        version = f.read()
    tag = hashlib.sha256((SOURCE + version + torch_dir).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"fake_cuda_runtime_{tag}.so")
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    compiler = os.environ.get("CXX", "c++")
    lib = os.path.join(torch_dir, "lib")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "runtime.cpp"), os.path.join(tmp, "runtime.so")
        with open(src, "w") as f:
            f.write(SOURCE)
        cmd = [compiler, "-O1", "-w", "-shared", "-fPIC", "-std=c++17", f"-I{os.path.join(torch_dir, 'include')}",
               src, f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-o", out]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            raise RuntimeUnavailable(f"the CUDA rehearsal needs a C++ compiler ({compiler!r} not found; set CXX)")
        if proc.returncode != 0:
            raise RuntimeUnavailable(f"building the CUDA rehearsal's runtime stand-in failed: "
                                     f"{(proc.stderr.strip().splitlines() or [''])[-1]}")
        os.replace(out, path)  # atomic: a concurrent build never leaves half a library
    return path


BOOTSTRAP = ("import ctypes, sys; ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL); "
             "from megand.tools import fake_cuda; fake_cuda.LOADED = True; "
             "import importlib; module, function = sys.argv[2].rsplit(':', 1); "
             "getattr(importlib.import_module(module), function)(sys.argv[3:])")


def child_command(entry: str, argv: list[str]) -> list[str]:
    """The command running ``entry`` (``"package.module:function"``, called with ``argv``) in a fresh
    Python process with the stand-in runtime loaded before torch."""
    return [sys.executable, "-c", BOOTSTRAP, library_path(), entry, *argv]


def run_child(entry: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run :func:`child_command` from this repository's root on the import path."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return subprocess.run(child_command(entry, argv), env=env, **kwargs)


def runtime_loaded() -> bool:
    """Whether this process runs with the stand-in runtime (CUDA is the accelerator on a CPU build)."""
    if not LOADED:
        return False
    return bool(ctypes.CDLL(None).rehearsal_cuda_runtime_loaded())


# -- the Python side of the runtime --------------------------------------------------------------------

class FakeStream:
    """``torch.cuda.Stream``: work ordering is not modelled (fake tensors run at once)."""

    def __init__(self, runtime, device=None, priority=0, **_):
        self.runtime, self.device, self.priority = runtime, device, priority

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or FakeEvent(self.runtime)
        event.record(self)
        return event

    def query(self):
        return True

    def synchronize(self):
        self.runtime.sync("torch.cuda.Stream.synchronize")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeEvent:
    """``torch.cuda.Event``: timings read 0 ms; ``synchronize`` and ``elapsed_time`` are host waits."""

    def __init__(self, runtime, enable_timing=False, blocking=False, interprocess=False):
        self.runtime, self.enable_timing = runtime, enable_timing

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        self.runtime.sync("torch.cuda.Event.synchronize")

    def elapsed_time(self, other):
        self.runtime.sync("torch.cuda.Event.elapsed_time")
        return 0.0


CUDA_STATE_BYTES = 16  # a CUDA (Philox) generator's state: seed and offset, 8 bytes each


class CudaRuntime:
    """Patches ``torch.cuda`` (and ``torch.Generator`` for CUDA devices) while entered.

    ``sync(what)``: called for every host wait the runtime stands in for (``synchronize``, event and
    stream waits, memory statistics that a real run would only read, not wait for, are not syncs).
    ``live_bytes()`` / ``peak_bytes()`` / ``reset_peak()``: the rehearsal's memory count, served as
    ``memory_allocated`` / ``max_memory_allocated`` / ``reset_peak_memory_stats``; ``name``,
    ``total_bytes``, ``capability`` and ``sms``: the device's properties as torch reports them."""

    def __init__(self, name: str, total_bytes: int, sync, live_bytes, peak_bytes, reset_peak, devices: int = 8,
                 capability: tuple[int, int] = (9, 0), sms: int = 132):
        self.name, self.total_bytes, self.devices = name, total_bytes, devices
        self.capability, self.sms = tuple(capability), sms
        self.sync, self.live_bytes, self.peak_bytes, self.reset_peak = sync, live_bytes, peak_bytes, reset_peak
        self.current = 0
        self.states: dict[int, tuple[int, int]] = {}  # device index -> (seed, offset)
        self._stack = contextlib.ExitStack()

    # the CUDA generator --------------------------------------------------------------------------------
    def _index(self, device) -> int:
        import torch

        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return self.current if device.index is None else device.index

    def _state_tensor(self, seed: int, offset: int):
        import numpy as np
        import torch

        # a real host tensor, as torch.cuda.get_rng_state returns (from numpy: no dispatch, so the fake
        # tensor mode neither sees nor wraps it)
        return torch.from_numpy(np.array([seed, offset], dtype=np.int64).view(np.uint8).copy())

    def get_rng_state(self, device="cuda"):
        seed, offset = self.states.get(self._index(device), (0, 0))
        return self._state_tensor(seed, offset)

    def set_rng_state(self, state, device="cuda"):
        import torch

        if state.dtype != torch.uint8 or state.numel() != CUDA_STATE_BYTES:
            raise RuntimeError(f"torch.cuda.set_rng_state: the CUDA generator takes a {CUDA_STATE_BYTES}-byte state "
                               f"(seed, offset), got {state.numel()} elements of {state.dtype} (a CPU generator's "
                               f"state is 5056 bytes)")
        from torch._subclasses.fake_tensor import is_fake

        if not is_fake(state):  # a host tensor, read on the host (no dispatch): no device sync
            seed, offset = state.numpy().view("int64").tolist()
            self.states[self._index(device)] = (int(seed), int(offset))

    def manual_seed(self, seed, device=None):
        self.states[self._index(device)] = (int(seed) & (2**63 - 1), 0)

    def manual_seed_all(self, seed):
        for i in range(self.devices):
            self.manual_seed(seed, i)

    def generator_class(self):
        import torch

        real, runtime = torch.Generator, self

        class Generator(real):
            """A CUDA generator stand-in (CPU-backed) whose state has the CUDA format."""

            def __new__(cls, device="cpu"):
                cuda = torch.device(device).type == "cuda"
                gen = real.__new__(cls, "cpu" if cuda else device)
                gen._cuda_seed = 0 if cuda else None
                return gen

            def __init__(self, device="cpu"):
                pass

            def manual_seed(self, seed):
                if self._cuda_seed is not None:
                    self._cuda_seed = int(seed)
                return super().manual_seed(seed)

            def get_state(self):
                if self._cuda_seed is None:
                    return super().get_state()
                return runtime._state_tensor(self._cuda_seed, 0)

        return Generator

    # patching ------------------------------------------------------------------------------------------
    def __enter__(self):
        import torch
        from unittest import mock

        major, minor = self.capability
        props = type("FakeDeviceProperties", (), {"name": self.name, "total_memory": self.total_bytes,
                                                  "major": major, "minor": minor, "multi_processor_count": self.sms})()
        runtime = self
        patches = {
            "is_available": lambda: True, "is_initialized": lambda: True, "device_count": lambda: self.devices,
            "current_device": lambda: self.current, "set_device": self._set_device,
            "get_device_name": lambda device=None: self.name, "get_device_properties": lambda device=None: props,
            "get_device_capability": lambda device=None: self.capability, "is_bf16_supported": lambda *a, **k: True,
            "mem_get_info": lambda device=None: (self.total_bytes - self.live_bytes(), self.total_bytes),
            "memory_allocated": lambda device=None: self.live_bytes(),
            "max_memory_allocated": lambda device=None: self.peak_bytes(),
            "memory_reserved": lambda device=None: self.live_bytes(),
            "max_memory_reserved": lambda device=None: self.peak_bytes(),
            "reset_peak_memory_stats": lambda device=None: self.reset_peak(),
            "empty_cache": lambda: None,
            "synchronize": lambda device=None: self.sync("torch.cuda.synchronize"),
            "get_rng_state": self.get_rng_state, "set_rng_state": self.set_rng_state,
            "manual_seed": self.manual_seed, "manual_seed_all": self.manual_seed_all,
            "Stream": lambda *a, **k: FakeStream(runtime, *a, **k),
            "Event": lambda *a, **k: FakeEvent(runtime, *a, **k),
            "current_stream": lambda device=None: FakeStream(runtime, device),
            "default_stream": lambda device=None: FakeStream(runtime, device),
            "stream": lambda s=None: contextlib.nullcontext(s),
        }
        for name, value in patches.items():
            self._stack.enter_context(mock.patch.object(torch.cuda, name, value))
        self._stack.enter_context(mock.patch.object(torch.cuda.random, "manual_seed_all", self.manual_seed_all))
        self._stack.enter_context(mock.patch.object(torch, "Generator", self.generator_class()))
        self.manual_seed_all(torch.initial_seed())
        return self

    def _set_device(self, device):
        self.current = self._index(device)

    def __exit__(self, *exc):
        self._stack.close()
        return False
