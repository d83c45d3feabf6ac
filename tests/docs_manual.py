"""Read the user manual (README.md and docs/*.md) as the test suite checks it: its shell commands, inline
commands, configuration keys, repository paths, links and measured figures.

A command is checked without running it: the tool's own argparse parser reads its arguments (the parser
is stopped the moment it has parsed, before the tool does any work), and its Hydra overrides are composed
against the schema and conf/ exactly as ``pretrain_gpt.py`` composes them. A shell block preceded by

    <!-- docs-test: run -->                     (or: run with key=value ...)

is also run for real in the default suite (the overrides after ``with`` are appended to each training
command, to keep it tiny), one preceded by ``<!-- docs-test: slow-run ... -->`` only under ``-m slow``.
Every other shell block of commands says why it does not run: ``<!-- docs-test: not-run (reason) -->``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import glob
import importlib
import importlib.util
import inspect
import io
import os
import re
import runpy
import shlex
import sys
import tomllib
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUPS = ("model", "parallel", "train", "optim", "data", "checkpoint", "logging")


def manual_files() -> list[str]:
    """README.md and every page of docs/, as paths relative to the repository root."""
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


# ----------------------------------------------------------------------------------------------- blocks

@dataclass
class Block:
    path: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None = None  # the docs-test directive before it: "run ...", "slow-run ..."

    def where(self, offset: int = 0) -> str:
        return f"{self.path}:{self.line + 1 + offset}"


def blocks(rel: str) -> list[Block]:
    """The fenced code blocks of a markdown file, each with the ``docs-test`` directive just before it."""
    out, lines, i = [], read(rel).split("\n"), 0
    while i < len(lines):
        m = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang, body = i, m.group(1), []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        marker, j = None, start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0:
            d = re.match(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$", lines[j])
            marker = d.group(1) if d else None
        out.append(Block(rel, start + 1, lang, "\n".join(body), marker))
        i += 1
    return out


def prose(rel: str) -> str:
    """The file with its fenced blocks and HTML comments blanked out (line numbers kept)."""
    text = read(rel)
    text = re.sub(r"(?ms)^\s*```.*?^\s*```\s*$", lambda m: "\n" * m.group(0).count("\n"), text)
    return re.sub(r"(?s)<!--.*?-->", lambda m: "\n" * m.group(0).count("\n"), text)


SHELL = ("bash", "sh", "shell", "console")


def expected_exit(block: Block) -> int:
    """The exit code a ``docs-test: run exit=N`` block documents (0 by default)."""
    m = re.search(r"\bexit=(\d+)", block.marker or "")
    return int(m.group(1)) if m else 0


def expected_output(block: Block) -> list[str]:
    """The texts a ``docs-test: run "text" ...`` block documents in its output (stdout or stderr)."""
    return re.findall(r'"([^"]*)"', (block.marker or "").split(" with ", 1)[0])


@dataclass
class Command:
    where: str
    argv: list[str]
    block: Block | None = None
    text: str = ""

    def __str__(self):
        return f"{self.where}: {self.text or shlex.join(self.argv)}"


def split_commands(text: str) -> list[list[str]]:
    """Shell text -> argument lists: continuations joined, comments dropped, split at ``&&``, ``;``, ``|``;
    leading environment assignments (``OMP_NUM_THREADS=1 python ...``) taken off."""
    text = text.replace("\\\n", " ")
    out = []
    for line in text.split("\n"):
        line = re.sub(r"^\s*\$ ", "", line)  # a prompt
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split, lex.commenters = True, "#"
        current = []
        for token in list(lex) + [";"]:
            if token in ("&&", "||", ";", "|", "&"):
                while current and re.match(r"^[A-Z_][A-Z0-9_]*=", current[0]):
                    current.pop(0)
                while current and current[0] in ("env", "nohup", "timeout", "time"):
                    wrapper = current.pop(0)
                    if wrapper == "timeout" and current and re.match(r"^\d", current[0]):
                        current.pop(0)
                if current:
                    out.append(current)
                current = []
            else:
                current.append(token)
    return out


def block_commands(block: Block) -> list[Command]:
    out, offset = [], 0
    for raw in re.split(r"(?<!\\)\n", block.text):
        for argv in split_commands(raw):
            out.append(Command(block.where(offset), argv, block, raw.strip()))
        offset += raw.count("\n") + 1
    return out


def shell_commands() -> list[Command]:
    """Every command of every shell block of the manual, and the command lines of unlabeled blocks."""
    out = []
    for rel in manual_files():
        for b in blocks(rel):
            if b.lang in SHELL:
                out += block_commands(b)
            elif not b.lang:  # output, trees, ...: only the lines that are one of megand's commands
                for offset, line in enumerate(b.text.split("\n")):
                    if COMMAND_START.match(line.strip()):
                        out += [Command(b.where(offset), argv, b, line.strip()) for argv in split_commands(line)]
    return out


def inline_spans(rel: str) -> list[tuple[str, str]]:
    """``(where, text)`` of every inline code span in the prose of a file (a span may wrap onto the next
    line, never across a paragraph)."""
    text, out = prose(rel), []
    for m in re.finditer(r"(`+)((?:(?!\n\s*\n).)+?)\1", text, re.S):
        out.append((f"{rel}:{text.count(chr(10), 0, m.start()) + 1}", " ".join(m.group(2).split())))
    return out


COMMAND_START = re.compile(r"^(python3? \S|torchrun .*\.py|megand-[a-z-]+ \S|make [a-z])")
OVERRIDE = re.compile(r"^\+?(experiment|%s)(\.[a-z_0-9]+)*=\S+$" % "|".join(GROUPS))
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|…|\[-")


def inline_commands() -> list[Command]:
    """Inline code spans that are whole commands (``python SCRIPT ...``, ``torchrun ... SCRIPT``,
    ``megand-NAME ARGS``, ``make TARGET``); a span with a placeholder (``<shape>``, ``...``) is prose."""
    out = []
    for rel in manual_files():
        for where, span in inline_spans(rel):
            if PLACEHOLDER.search(span):
                continue
            if re.match(r"^(benchmarks|tools)/\w+\.py \S", span):  # a figure's command named by its script
                span = "python " + span
            if COMMAND_START.match(span):
                for argv in split_commands(span):
                    out.append(Command(where, argv, None, span))
            elif len(span.split()) >= 2 and all(OVERRIDE.match(t) for t in span.split()):
                # a list of overrides quoted for a figure or a recipe: as pretrain_gpt.py would compose it
                out.append(Command(where, ["python", "pretrain_gpt.py", *span.split()], None, span))
    return out


# ------------------------------------------------------------------------------------ parsing, not running

class Parsed(Exception):
    """Raised the moment a tool's parser has read its arguments: the tool stops before any work."""

    def __init__(self, result):
        super().__init__("parsed")
        self.result = result


class BadArguments(Exception):
    pass


@contextlib.contextmanager
def parse_only():
    """Every argparse parser raises ``Parsed`` as soon as its outermost parse returns, and ``BadArguments``
    (instead of printing usage and exiting) on an unknown flag, a missing required one or a bad value."""
    names = ("parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args")
    originals = {name: getattr(argparse.ArgumentParser, name) for name in names}
    original_error, original_exit = argparse.ArgumentParser.error, argparse.ArgumentParser.exit
    depth = [0]

    def stopping(original):
        def parse(self, *args, **kwargs):
            depth[0] += 1
            try:
                result = original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise Parsed(result)
            return result
        return parse

    def error(self, message):
        raise BadArguments(f"{self.prog}: {message}")

    def exit(self, status=0, message=None):  # --help (and --version) print and exit 0: they parsed
        if status:
            raise BadArguments(f"{self.prog}: {message}")
        raise Parsed(argparse.Namespace())

    for name in names:
        setattr(argparse.ArgumentParser, name, stopping(originals[name]))
    argparse.ArgumentParser.error, argparse.ArgumentParser.exit = error, exit
    try:
        yield
    finally:
        for name in names:
            setattr(argparse.ArgumentParser, name, originals[name])
        argparse.ArgumentParser.error, argparse.ArgumentParser.exit = original_error, original_exit


def parse_with(call) -> tuple[argparse.Namespace, list[str]]:
    """Run ``call`` until its argparse parser has read the arguments: ``(namespace, leftover arguments)``."""
    with parse_only(), contextlib.redirect_stdout(io.StringIO()):
        try:
            call()
        except Parsed as p:
            result = p.result
            return (result, []) if isinstance(result, argparse.Namespace) else (result[0], list(result[1]))
    raise BadArguments("the command finished without parsing any arguments")


def console_scripts() -> dict[str, str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def tool_module(script: str) -> str | None:
    """``tools/estimate.py`` -> ``megand.tools.estimate`` (the back-end its wrapper calls)."""
    m = re.match(r"^tools/(\w+)\.py$", script)
    return f"megand.tools.{m.group(1)}" if m else None


def check_overrides(overrides: list[str]) -> None:
    """Hydra overrides compose against the schema and conf/ (keys exist, presets exist), and keys forced in
    with ``+`` are in the schema too (what ``pretrain_gpt.py`` checks before any work)."""
    from megand.training.config import ConfigError, check_keys, compose

    bad = [o for o in overrides if "=" not in o and not o.startswith("~")]
    if bad:
        raise BadArguments(f"not a key=value override: {bad}")
    try:
        cfg = compose(overrides)
        check_keys(cfg)
    except ConfigError as e:
        raise BadArguments(str(e)) from None
    except Exception as e:  # Hydra's and OmegaConf's own errors: unknown key, missing preset
        raise BadArguments(" ".join(str(e).split("Config search path")[0].split())) from None


def check_main(module: str, args: list[str], function: str = "main") -> None:
    """A tool's ``main(argv)`` parses ``args``; its Hydra overrides (and a launched script) are checked."""
    mod = importlib.import_module(module)
    main = getattr(mod, function)
    if not inspect.signature(main).parameters:
        if args:
            raise BadArguments(f"{module}.{function} takes no arguments, got {args}")
        return
    namespace, leftover = parse_with(lambda: main(list(args)))
    check_parsed(namespace, leftover)


def check_parsed(namespace: argparse.Namespace, leftover: list[str]) -> None:
    overrides = list(getattr(namespace, "overrides", None) or []) + leftover
    if getattr(namespace, "training_script", None):  # tools/launch.py and torchrun: the launched script
        check_script(namespace.training_script, list(namespace.training_script_args))
    elif overrides:
        check_overrides(overrides)


def check_script(script: str, args: list[str]) -> None:
    """``python SCRIPT ARGS``: the file exists and its arguments parse."""
    rel = os.path.normpath(script)
    if not os.path.isfile(os.path.join(ROOT, rel)):
        raise BadArguments(f"{script}: no such file in the repository")
    if rel == "pretrain_gpt.py":
        check_overrides(args)
    elif tool_module(rel):
        check_main(tool_module(rel), args)
    elif "argparse" in read(rel):
        sys_argv = sys.argv
        sys.argv = [rel, *args]
        try:
            namespace, leftover = parse_with(lambda: runpy.run_path(os.path.join(ROOT, rel), run_name="__main__"))
        finally:
            sys.argv = sys_argv
        if leftover:
            raise BadArguments(f"unrecognized arguments: {leftover}")
        check_parsed(namespace, [])
    elif args:
        raise BadArguments(f"{script} takes no arguments (it has no argument parser), got {args}")


def check_torchrun(args: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    namespace, _ = parse_with(lambda: get_args_parser().parse_args(args))
    if namespace.module:  # torchrun -m MODULE
        check_command(["python", "-m", namespace.training_script, *namespace.training_script_args])
    else:
        check_script(namespace.training_script, list(namespace.training_script_args))


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", read("Makefile"), re.M))


def check_command(argv: list[str]) -> bool:
    """Check one command; False when it is not one of megand's (pip, wandb, ...), which is left alone."""
    program, args = argv[0], argv[1:]
    if program in ("python", "python3"):
        if args[:1] == ["-m"]:
            module = args[1]
            if module == "torch.distributed.run":
                check_torchrun(args[2:])
            elif importlib.util.find_spec(module) is None:
                raise BadArguments(f"no module {module}")
            elif module.startswith("megand.tools.") and "argparse" in inspect.getsource(importlib.import_module(module)):
                check_main(module, args[2:])
            elif args[2:]:
                raise BadArguments(f"{module} takes no arguments, got {args[2:]}")
        else:
            check_script(args[0], args[1:])
    elif program == "torchrun":
        check_torchrun(args)
    elif program.startswith("megand-"):
        scripts = console_scripts()
        if program not in scripts:
            raise BadArguments(f"{program}: no such console script in pyproject.toml")
        module, function = scripts[program].split(":")
        check_main(module, args, function)
    elif program == "make":
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        missing = sorted(set(targets) - makefile_targets())
        if missing:
            raise BadArguments(f"no Makefile target {missing}")
    elif program == "sbatch":
        scripts = [a for a in args if a.endswith(".sbatch")]
        for s in scripts:
            if not os.path.isfile(os.path.join(ROOT, s)):
                raise BadArguments(f"{s}: no such file")
        if scripts:
            check_overrides(args[args.index(scripts[0]) + 1:])
    else:
        return False
    return True


# ------------------------------------------------------------------------------------- keys, paths, codes

def schema_keys() -> set[str]:
    from megand.tools.config_reference import keys

    return set(keys())


FILE_NAME = re.compile(r"\.(json|safetensors|yaml|py|model|bin|idx|jsonl|tiktoken)$")
KEY_SPAN = re.compile(r"^\+*(%s)\.([a-z_][a-z0-9_.]*[a-z0-9_])(=.*)?$" % "|".join(GROUPS))


def prose_keys() -> list[tuple[str, str]]:
    """``(where, key)`` of inline code spans naming a configuration key (``optim.sharding``, ``train.iters=5``)."""
    out = []
    for rel in manual_files():
        for where, span in inline_spans(rel):
            m = KEY_SPAN.match(span)
            if m and " " not in span.split("=")[0] and not FILE_NAME.search(span.split("=")[0]):
                out.append((where, f"{m.group(1)}.{m.group(2)}"))
    return out


PRESET_SPAN = re.compile(r"^\+?(experiment|%s)=(\w+)$" % "|".join(GROUPS))


def prose_presets() -> list[tuple[str, str]]:
    """``(where, conf/GROUP/NAME.yaml)`` of inline code spans choosing a preset (``model=llama_8b``)."""
    out = []
    for rel in manual_files():
        for where, span in inline_spans(rel):
            m = PRESET_SPAN.match(span)
            if m and not m.group(2).isupper():  # model=NAME: a placeholder
                out.append((where, f"conf/{m.group(1)}/{m.group(2)}.yaml"))
    return out


PATH_SPAN = re.compile(r"^(megand|tests|benchmarks|tools|conf|examples|docs)/[\w./-]*$")


def prose_paths() -> list[tuple[str, str]]:
    """``(where, path)`` of inline code spans naming a file or folder of the repository."""
    out = []
    for rel in manual_files():
        for where, span in inline_spans(rel):
            if PATH_SPAN.match(span) and not re.search(r"\*|\.\.\.|[A-Z]{2,}", span):  # NAME, ...: placeholders
                out.append((where, span))
    return out


def training_exit_codes() -> set[int]:
    """Every exit code ``pretrain_gpt.py`` can end with: the literal or named codes of ``sys.exit``,
    ``os._exit`` and ``SystemExit`` in it and in megand/training (names resolved from megand/training's
    ``EXIT_*`` constants), and 0."""
    constants = {}
    files = [os.path.join(ROOT, "pretrain_gpt.py")] + glob.glob(os.path.join(ROOT, "megand", "training", "*.py"))
    trees = [ast.parse(open(f).read()) for f in files]
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.startswith("EXIT_"):
                        constants[target.id] = node.value.value
    codes = {0}
    for tree in trees:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            name = ast.unparse(node.func)
            if name not in ("sys.exit", "os._exit", "SystemExit", "exit"):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, int):
                codes.add(arg.value)
            elif isinstance(arg, ast.Name) and arg.id in constants:
                codes.add(constants[arg.id])
            elif isinstance(arg, ast.Name) and arg.id.startswith("EXIT_"):
                raise AssertionError(f"exit code {arg.id} is not defined in megand/training")
    return codes


def documented_exit_codes(rel: str = "docs/long-runs.md") -> set[int]:
    """The codes in the first column of the exit-code table (the one headed ``| exit code |``)."""
    text = read(rel)
    table = text.split("| exit code |", 1)[1].split("\n\n", 1)[0]
    return {int(m) for m in re.findall(r"^\|\s*(\d+)\s*\|", table, re.M)}


# ------------------------------------------------------------------------------------------------ links

def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(rel: str) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+\s+(.*)$", prose(rel), re.M)}


def links(rel: str) -> list[tuple[str, str]]:
    """``(where, target)`` of every relative markdown link of a file."""
    out = []
    for n, line in enumerate(prose(rel).split("\n"), 1):
        for m in re.finditer(r"\]\(([^)\s]+)\)", line):
            target = m.group(1)
            if not re.match(r"^[a-z]+:", target):
                out.append((f"{rel}:{n}", target))
    return out


def resolve(rel: str, target: str) -> tuple[str, str]:
    """A link target -> (repository-relative path, anchor)."""
    path, _, anchor = target.partition("#")
    path = os.path.normpath(os.path.join(os.path.dirname(rel), path)) if path else rel
    return path, anchor


# ---------------------------------------------------------------------------------------------- figures

FIGURE = re.compile(r"\d[\d,.]*\s?(k|M)?\s?(tokens/s|s/step|ms\b|MB/s|GB/s|GFLOP/s|TFLOP/s|MB\b|GB\b|GiB\b|CPU-minutes|"
                    r"minutes\b|min\b|% (fast|slow|error))")
NAMES_COMMAND = re.compile(r"`(python3? |torchrun |make |megand-)[^`]*`|`(benchmarks|tools)/\w+\.py[^`]*`")
NOT_MEASURED = "docs-test: not-measured"


@dataclass
class Paragraph:
    path: str
    line: int
    text: str
    exempt: bool = False
    lines: list[str] = field(default_factory=list)


def paragraphs(rel: str) -> list[Paragraph]:
    """The prose paragraphs of a file (a table with the paragraph just before it counts as one);
    ``<!-- docs-test: not-measured -->`` before a paragraph marks quoted (not measured) figures."""
    raw = read(rel).split("\n")
    text = prose(rel).split("\n")
    out, current, start = [], [], 0
    for n, line in enumerate(text + [""]):
        if line.strip():
            if not current:
                start = n
            current.append(line)
            continue
        if current:
            before = start - 1
            while before >= 0 and not raw[before].strip():
                before -= 1
            exempt = before >= 0 and NOT_MEASURED in raw[before]
            para = Paragraph(rel, start + 1, "\n".join(current), exempt)
            if current[0].lstrip().startswith("|") and out and not out[-1].text.lstrip().startswith("|"):
                out[-1].text += "\n" + para.text  # a table goes with the sentence that introduces it
                out[-1].exempt = out[-1].exempt or exempt
            else:
                out.append(para)
            current = []
    return out


def figures_without_command() -> list[str]:
    """Paragraphs quoting measured figures (throughput, time, memory) that name no command."""
    bad = []
    for rel in manual_files():
        if rel == "docs/configuration.md":  # generated from the schema: defaults, not measurements
            continue
        for p in paragraphs(rel):
            figure = FIGURE.search(p.text)
            if figure and not p.exempt and not NAMES_COMMAND.search(p.text):
                bad.append(f"{p.path}:{p.line}: {figure.group(0)!r} in a paragraph that names no command")
    return bad


# ------------------------------------------------------------------------------------ generated tables

@dataclass
class OutputTable:
    where: str
    command: str
    table: str
    slow: bool


def output_tables() -> list[OutputTable]:
    """Tables preceded by ``<!-- docs-test: output COMMAND -->`` (or ``slow-output``): the command's output."""
    out = []
    for rel in manual_files():
        lines = read(rel).split("\n")
        for n, line in enumerate(lines):
            m = re.match(r"^\s*<!--\s*docs-test:\s*(slow-)?output\s+(.*?)\s*-->\s*$", line)
            if not m:
                continue
            rows, i = [], n + 1
            while i < len(lines) and not lines[i].strip():
                i += 1
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(lines[i])
                i += 1
            out.append(OutputTable(f"{rel}:{n + 1}", m.group(2), "\n".join(rows), bool(m.group(1))))
    return out


# -------------------------------------------------------------------------------------- troubleshooting

def troubleshooting_messages(rel: str = "docs/troubleshooting.md") -> list[tuple[str, str]]:
    """``(where, message)`` of each quoted error heading (``### `message` ``)."""
    out = []
    for n, line in enumerate(read(rel).split("\n"), 1):
        m = re.match(r"^###\s+`(.+)`\s*$", line)
        if m:
            out.append((f"{rel}:{n}", m.group(1)))
    return out


def source_text() -> str:
    """megand's sources and pretrain_gpt.py, adjacent string literals joined (as Python joins them)."""
    parts = []
    for f in sorted(glob.glob(os.path.join(ROOT, "megand", "**", "*.py"), recursive=True)) + \
            [os.path.join(ROOT, "pretrain_gpt.py")]:
        parts.append(open(f).read())
    text = "\n".join(parts)
    return re.sub(r"[\"']\s*\n\s*[rfb]*[\"']", "", text)


def report_labels() -> set[str]:
    """What ``pretrain_gpt.py`` prints after ``megand: `` (``report(e, "invalid configuration")``)."""
    return set(re.findall(r'report\(e, "([^"]+)"\)', read("pretrain_gpt.py")))


def message_pieces(message: str) -> list[str]:
    """The literal pieces of a documented message (``…`` stands for values), without the prefix that
    ``pretrain_gpt.py`` or a tool puts before the exception's text."""
    for label in report_labels():
        if message.startswith(f"megand: {label}: "):
            message = message[len(f"megand: {label}: "):]
            break
    else:
        if message.startswith("megand: "):
            message = message[len("megand: "):]
    return [p.strip() for p in message.split("…") if len(p.strip()) >= 4]
