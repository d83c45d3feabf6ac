"""The cluster file: groups of identical nodes (several groups: a heterogeneous cluster).

    groups:                      # each group: identical nodes
      - name: h100
        nodes: 8
        devices_per_node: 8
        device: h100             # optional: a known device (a100, a100-40gb, h100, h200, cpu) gives the
                                 # defaults of the keys below and its profile (GEMM curve, collectives)
        peak_tflops: 989         # dense peak per device in the training precision
        memory_gib: 80
        intra_node_gbps: 450     # GB/s per device, one direction, inside a node (bus bandwidth of collectives)
        inter_node_gbps: 50      # GB/s per device, one direction, across nodes
        profile: h100.json       # optional: a profile file from tools/calibrate.py (overrides `device:`'s)

Without ``device:`` and ``profile:`` the group needs every number, and a generic GEMM curve (the H100's
shape) is scaled to its peak. Numbers given in the file override the profile's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megand.tools.planner.defaults import DEVICES
from megand.tools.planner.profile import Profile, ProfileError

KEYS = ("name", "nodes", "devices_per_node", "device", "peak_tflops", "memory_gib", "intra_node_gbps",
        "inter_node_gbps", "profile")
NUMBERS = ("peak_tflops", "memory_gib", "intra_node_gbps", "inter_node_gbps")


class ClusterError(ValueError):
    """A cluster file that cannot be used; the message names the group, key and value."""


@dataclass(frozen=True)
class Group:
    name: str
    nodes: int
    devices_per_node: int
    memory_gib: float
    profile: Profile  # peak and link bandwidths already applied

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def peak_tflops(self) -> float:
        return self.profile.peak_tflops


@dataclass(frozen=True)
class Cluster:
    groups: tuple

    @property
    def devices(self) -> int:
        return sum(g.devices for g in self.groups)

    @property
    def heterogeneous(self) -> bool:
        return len(self.groups) > 1


def parse_cluster(data, where: str = "cluster", profile: Profile | None = None, base_dir: str = ".") -> Cluster:
    """A :class:`Cluster` from the parsed YAML; ``profile`` (``--profile``) replaces every group's profile
    (the group's own numbers still override its peak and bandwidths)."""
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list) or not data["groups"]:
        raise ClusterError(f"{where}: expected `groups:`, a non-empty list of node groups")
    groups, names = [], set()
    for i, g in enumerate(data["groups"]):
        if not isinstance(g, dict):
            raise ClusterError(f"{where}: groups[{i}] must be a mapping, got {g!r}")
        label = f"{where}: group {g.get('name', i)!r}"
        unknown = sorted(set(g) - set(KEYS))
        if unknown:
            raise ClusterError(f"{label}: unknown key(s) {', '.join(unknown)} (known: {', '.join(KEYS)})")
        name = str(g.get("name", f"group{i}"))
        if name in names:
            raise ClusterError(f"{where}: two groups are named {name!r}")
        names.add(name)
        for key in ("nodes", "devices_per_node"):
            if not isinstance(g.get(key), int) or isinstance(g.get(key), bool) or g[key] < 1:
                raise ClusterError(f"{label}: {key}={g.get(key)!r} must be a positive integer")
        known = {}
        if g.get("device") is not None:
            if g["device"] not in DEVICES:
                raise ClusterError(f"{label}: device={g['device']!r} is not known (known: {', '.join(DEVICES)}); "
                                   f"give peak_tflops, memory_gib, intra_node_gbps and inter_node_gbps instead")
            known = DEVICES[g["device"]]
        group_profile = profile
        if group_profile is None and g.get("profile") is not None:
            try:
                group_profile = Profile.load(os.path.join(base_dir, str(g["profile"])))
            except ProfileError as e:
                raise ClusterError(f"{label}: {e}") from None
        if group_profile is not None:  # a measured profile: its own peak and bandwidths are the defaults
            known = {**known, "peak_tflops": group_profile.peak_tflops,
                     "intra_node_gbps": group_profile.collectives["intra_node"]["all_reduce"]["gbps"],
                     "inter_node_gbps": group_profile.collectives["inter_node"]["all_reduce"]["gbps"]}
        else:
            group_profile = known.get("profile", DEVICES["h100"]["profile"])
        numbers = {}
        for key in NUMBERS:
            value = g.get(key, known.get(key))
            if value is None:
                raise ClusterError(f"{label}: {key} is missing (or name a known device with device:)")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ClusterError(f"{label}: {key}={value!r} must be a positive number")
            numbers[key] = float(value)
        if "peak_tflops" in g:
            group_profile = group_profile.with_peak(numbers["peak_tflops"])  # the efficiency curve, at this peak
        for link, key in (("intra_node", "intra_node_gbps"), ("inter_node", "inter_node_gbps")):
            if key in g:
                group_profile = group_profile.with_link_gbps(link, numbers[key])
        groups.append(Group(name=name, nodes=g["nodes"], devices_per_node=g["devices_per_node"],
                            memory_gib=numbers["memory_gib"], profile=group_profile))
    return Cluster(groups=tuple(groups))


def load_cluster(path: str, profile: Profile | None = None) -> Cluster:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ClusterError(f"cannot read cluster file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ClusterError(f"cluster file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    return parse_cluster(data, where=f"cluster {path}", profile=profile,
                         base_dir=os.path.dirname(os.path.abspath(path)))
