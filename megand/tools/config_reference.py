"""Print the configuration reference (markdown) from the structured schema in megand/training/config.py
and the presets in conf/.

docs/configuration.md holds this output between its ``<!-- config-reference:... -->`` and
``<!-- presets:... -->`` markers; ``--write`` rewrites them there, and a test keeps the two equal.
"""

import argparse
import dataclasses
import inspect
import os
import re

from megand.training import config

DOC = os.path.join(os.path.dirname(config.CONF_DIR), "docs", "configuration.md")


def field_comments(cls) -> dict[str, str]:
    """The trailing ``# comment`` of each field in the dataclass source."""
    source = inspect.getsource(cls)
    comments = {}
    for line in source.splitlines():
        node = line.strip()
        if ":" in node and "#" in node and not node.startswith("#"):
            name = node.split(":", 1)[0].strip()
            comments[name] = node.split("#", 1)[1].strip().replace("|", "\\|")
    return comments


def rows(cls, prefix=""):
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name == "hydra":
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            yield from rows(type(default), f"{prefix}{f.name}.")
            continue
        yield f"| `{prefix}{f.name}` | `{default!r}` | {comments.get(f.name, '')} |"


def keys(cls=config.Config, prefix="") -> list[str]:
    """Every dotted key of the schema."""
    return [row.split("`")[1] for row in rows(cls, prefix)]


def reference() -> str:
    lines = ["| key | default | meaning |", "| --- | --- | --- |", *rows(config.Config)]
    return "\n".join(lines) + "\n"


def preset_summary(path: str) -> str:
    """The first sentence of a preset file's header comment."""
    text = []
    for line in open(path):
        if not line.startswith("#"):
            break
        line = line.lstrip("#").strip()
        if line and not line.startswith("@package"):
            text.append(line)
    summary, depth = " ".join(text), 0
    for i, char in enumerate(summary):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and char in ".:;" and (i + 1 == len(summary) or summary[i + 1] == " "):
            summary = summary[:i]
            break
    return summary.replace("|", "\\|")


def presets(conf_dir: str = config.CONF_DIR) -> str:
    """Each group of conf/ with its presets: how to pick one and what it is."""
    lines = ["| group | pick with | preset | what it is |", "| --- | --- | --- | --- |"]
    for group in sorted(d for d in os.listdir(conf_dir) if os.path.isdir(os.path.join(conf_dir, d))):
        for file in sorted(f for f in os.listdir(os.path.join(conf_dir, group)) if f.endswith(".yaml")):
            name = file[:-len(".yaml")]
            pick = f"+{group}={name}" if group == "experiment" else f"{group}={name}"
            lines.append(f"| {group} | `{pick}` | `{name}` | {preset_summary(os.path.join(conf_dir, group, file))} |")
    return "\n".join(lines) + "\n"


def replace_section(text: str, marker: str, body: str) -> str:
    """``text`` with what lies between ``<!-- marker:start -->`` and ``<!-- marker:end -->`` replaced by ``body``."""
    start, end = f"<!-- {marker}:start -->\n", f"<!-- {marker}:end -->"
    head, rest = text.split(start, 1)
    return head + start + body + end + rest.split(end, 1)[1]


def write(path: str) -> None:
    text = open(path).read()
    text = replace_section(text, "config-reference", reference())
    text = replace_section(text, "presets", presets())
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", action="store_true", help="print the presets of conf/ instead of the keys")
    p.add_argument("--write", metavar="FILE", nargs="?", const=DOC, default=None,
                   help="rewrite both generated sections of FILE in place (default: docs/configuration.md)")
    args = p.parse_args(argv)
    if args.write:
        write(args.write)
    else:
        print(presets() if args.presets else reference(), end="")
