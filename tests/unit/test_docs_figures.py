"""Memory figures the pages and the presets' headers quote from tools/estimate.py are what it prints.

Tolerance: a figure written with ``~`` within 5%; any other within half a unit of its last digit (52.7
stands for 52.65..52.75), i.e. the figure is the printed one rounded as written.
"""

import os
import re

import pytest

from megand.tools.estimate import main as estimate_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESET_FIGURE = re.compile(r"[Ee]stimated (~?)([\d.]+) GiB")
DOC_FIGURE = re.compile(r"`python tools/estimate\.py (\+experiment=\w+ --world-size \d+)`(?: prints)? (~?)([\d.]+) GiB")


def quoted_figures():
    found = []
    for name in sorted(os.listdir(os.path.join(ROOT, "conf", "experiment"))):
        path = os.path.join(ROOT, "conf", "experiment", name)
        header = "".join(line for line in open(path) if line.startswith("#"))
        world = re.search(r"_(\d+)gpu\.yaml$", name)
        for m in PRESET_FIGURE.finditer(" ".join(header.replace("#", " ").split())):
            if world:
                found.append((f"conf/experiment/{name}", f"+experiment={name[:-5]} --world-size {world.group(1)}",
                              m.group(1), m.group(2)))
    for name in sorted(os.listdir(os.path.join(ROOT, "docs"))):
        text = " ".join(open(os.path.join(ROOT, "docs", name)).read().split())
        for m in DOC_FIGURE.finditer(text):
            found.append((f"docs/{name}", m.group(1), m.group(2), m.group(3)))
    return found


FIGURES = quoted_figures()


def test_figures_are_found():
    assert len(FIGURES) >= 10  # the presets' headers and model-families.md's sentences


@pytest.mark.parametrize("where, args, approx, figure", FIGURES, ids=[f"{w}:{a.split()[0]}" for w, a, _, _ in FIGURES])
def test_quoted_estimate_is_what_the_tool_prints(where, args, approx, figure, capsys):
    assert estimate_main(args.split()) in (0, None)
    printed = float(re.search(r"^peak: stage \d+, ([\d.]+) GiB", capsys.readouterr().out, re.M).group(1))
    quoted = float(figure)
    if approx:
        assert abs(printed - quoted) <= 0.05 * printed, f"{where}: ~{figure} GiB, the tool prints {printed}"
    else:
        half_unit = 0.5 * 10 ** -len(figure.split(".")[1]) if "." in figure else 0.5
        assert abs(printed - quoted) <= half_unit + 1e-9, f"{where}: {figure} GiB, the tool prints {printed}"
