"""Every rank of every run imports the training stack: what it imports is start-up time (and a test
suite of short multi-process runs pays it for every process). torch.compile's machinery costs about
2 s per process to import; only a run that compiles may load it."""

import subprocess
import sys

from tests.harness import ROOT


def test_the_training_stack_does_not_import_the_compiler():
    code = ("import sys, megand.training.pretrain; "
            "print(sorted(m for m in sys.modules if m == 'torch._dynamo' or m.startswith('torch._inductor')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
