"""Print the configuration reference (markdown) from the structured schema in megand/training/config.py.

The README's "Configuration reference" section is this output; a test keeps the two equal.
"""

import dataclasses
import inspect


from megand.training import config


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


def reference() -> str:
    lines = ["| key | default | meaning |", "| --- | --- | --- |", *rows(config.Config)]
    return "\n".join(lines) + "\n"


def main() -> None:
    print(reference(), end="")
