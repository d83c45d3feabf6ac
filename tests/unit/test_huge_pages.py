"""The entry points ask torch's CPU allocator for huge pages before torch is imported (torch reads the setting
once, at its first allocation), and a user's own setting wins."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the setting as it stands when something first imports torch, then the entry point run with --help
WATCH = r"""
import importlib.abc, os, runpy, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("THP_MEM_ALLOC_ENABLE"))
sys.meta_path.insert(0, Watch())
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
print("setting when torch was imported:", seen)
"""


def _setting_at_torch_import(script, env):
    out = subprocess.run([sys.executable, "-c", WATCH, script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("script", ["pretrain_gpt.py", "tools/benchmark.py"])
def test_entry_points_ask_for_huge_pages_before_torch_is_imported(script):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env["PYTHONPATH"] = ROOT
    assert _setting_at_torch_import(script, env) == "setting when torch was imported: ['1']"
    env["THP_MEM_ALLOC_ENABLE"] = "0"  # the user's own choice
    assert _setting_at_torch_import(script, env) == "setting when torch was imported: ['0']"


def test_the_package_imports_nothing_that_allocates():
    code = "import sys, megand; megand.prefer_huge_pages(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.stdout.strip() == "False"
