"""The README's configuration reference is the one generated from the schema."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_readme_config_reference_is_generated_from_the_schema():
    generated = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "config_reference.py")],
                               capture_output=True, text=True, check=True,
                               env={**os.environ, "PYTHONPATH": ROOT}).stdout  # this checkout's schema
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("<!-- config-reference:start -->\n", 1)[1].split("<!-- config-reference:end -->", 1)[0]
    assert section == generated, "README out of date: run python tools/config_reference.py"
