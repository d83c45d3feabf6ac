"""The manual cannot drift from the code: every command in README.md and docs/*.md parses against the real
tools and configuration schema, the cheap ones run, keys and paths named in the prose exist, links
resolve, every page is reachable, every exit code is documented, quoted figures name their command and
the troubleshooting messages are the ones the code raises. See tests/docs_manual.py for how each is read."""

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests import docs_manual as manual

ROOT = manual.ROOT


def test_the_manual_has_its_pages():
    pages = set(manual.manual_files())
    assert {"README.md", "docs/index.md", "docs/configuration.md", "docs/troubleshooting.md",
            "docs/long-runs.md"} <= pages
    lines = len(manual.read("README.md").split("\n"))
    assert lines <= 200, f"README.md has {lines} lines: it is the front page, move details into docs/"


def test_every_shell_command_parses():
    """Flags exist, required ones are given, Hydra keys are in the schema and presets are in conf/."""
    failures, checked = [], 0
    for command in manual.shell_commands() + manual.inline_commands():
        if command.block and manual.expected_exit(command.block):
            continue  # a documented failure: test_cheap_commands_run checks it fails as documented
        try:
            checked += manual.check_command(command.argv)
        except manual.BadArguments as e:
            failures.append(f"{command}\n    -> {e}")
    assert checked >= 30, f"only {checked} commands found in the manual: is the extraction broken?"
    assert not failures, "commands in the manual that do not parse:\n" + "\n".join(failures)


def test_every_command_has_its_row_in_the_command_page():
    page = manual.read("docs/tools.md")
    tools = sorted(f"tools/{f}" for f in os.listdir(os.path.join(ROOT, "tools")) if f.endswith(".py"))
    missing = [name for name in tools + sorted(manual.console_scripts()) if f"`{name}`" not in page]
    assert not missing, f"commands missing from docs/tools.md: {missing}"


def test_keys_named_in_the_prose_exist():
    keys = manual.schema_keys()
    groups = {k.rsplit(".", n)[0] for k in keys for n in range(1, k.count(".") + 1)}  # logging.wandb, ...
    unknown = [f"{where}: {key}" for where, key in manual.prose_keys() if key not in keys | groups]
    assert not unknown, "configuration keys named in the manual but not in the schema:\n" + "\n".join(unknown)


def test_paths_and_presets_named_in_the_prose_exist():
    missing = [f"{where}: {path}" for where, path in manual.prose_paths() + manual.prose_presets()
               if not os.path.exists(os.path.join(ROOT, path))]
    assert not missing, "repository paths named in the manual that do not exist:\n" + "\n".join(missing)


def test_code_map_names_what_is_there():
    """The README's code map: each entry exists, and every package of megand/ has its line."""
    block = next(b for b in manual.blocks("README.md") if "megand/core/" in b.text and not b.lang)
    entries, parent = [], ""
    for line in block.text.split("\n"):
        name = line.split()[0] if line.strip() else ""
        if not line.startswith(" "):
            parent = name if name.endswith("/") else ""
            entries.append(name)
        elif line.startswith("  ") and not line.startswith("   ") and (name.endswith("/") or name.endswith(".py")):
            entries.append(parent + name)
    missing = [e for e in entries if not glob.glob(os.path.join(ROOT, e))]
    assert not missing, f"README code map entries that do not exist: {missing}"
    packages = sorted(f"megand/{d}/" for d in os.listdir(os.path.join(ROOT, "megand"))
                      if os.path.isfile(os.path.join(ROOT, "megand", d, "__init__.py")))
    assert not set(packages) - set(entries), f"packages missing from the README code map: {set(packages) - set(entries)}"


def test_links_resolve_and_every_page_is_linked():
    broken = []
    for rel in manual.manual_files():
        for where, target in manual.links(rel):
            path, anchor = manual.resolve(rel, target)
            if not os.path.exists(os.path.join(ROOT, path)):
                broken.append(f"{where}: {target} (no {path})")
            elif anchor and path.endswith(".md") and anchor not in manual.anchors(path):
                broken.append(f"{where}: {target} (no heading #{anchor} in {path})")
    assert not broken, "broken links:\n" + "\n".join(broken)
    linked = {manual.resolve(rel, t)[0] for rel in ("README.md", "docs/index.md") for _, t in manual.links(rel)}
    orphans = [p for p in manual.manual_files() if p != "README.md" and p not in linked]
    assert not orphans, f"pages linked from neither README.md nor docs/index.md: {orphans}"


def test_every_exit_code_is_documented():
    code, documented = manual.training_exit_codes(), manual.documented_exit_codes()
    assert code == documented, (f"pretrain_gpt.py can exit with {sorted(code)}; docs/long-runs.md's exit-code "
                                f"table lists {sorted(documented)}")


def test_figures_name_the_command_that_produced_them():
    bad = manual.figures_without_command()
    assert not bad, ("measured figures must name the command that produced them (or, for quoted figures, be "
                     "marked <!-- docs-test: not-measured -->):\n" + "\n".join(bad))


def test_troubleshooting_messages_are_raised_by_the_code():
    source = manual.source_text()
    stale = []
    for where, message in manual.troubleshooting_messages():
        pieces = manual.message_pieces(message)
        missing = [p for p in pieces if p not in source]
        if not pieces or missing:
            stale.append(f"{where}: {message!r}: not in megand's sources: {missing}")
    assert len(manual.troubleshooting_messages()) >= 15
    assert not stale, "documented errors that the code does not raise (reworded?):\n" + "\n".join(stale)


def check_output_table(table, tmp_path):
    argv = shlex.split(table.command)
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{table.where}: {table.command} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert table.table.strip() == proc.stdout.strip(), \
        f"{table.where}: the table is not what {table.command} prints now:\n{proc.stdout}"


@pytest.mark.slow
@pytest.mark.parametrize("table", [t for t in manual.output_tables() if t.slow], ids=lambda t: t.where)
def test_slow_tables_are_their_commands_output(table, tmp_path):
    check_output_table(table, tmp_path)


def test_tables_are_their_commands_output(tmp_path):
    for table in manual.output_tables():
        if not table.slow:
            check_output_table(table, tmp_path)


def run_block(block, tmp_path):
    """Run each command of a ``docs-test: run`` block for real, in ``tmp_path``, with the directive's
    ``with`` overrides appended to training commands; ``exit=N`` expects that exit code (a documented
    error) and each ``"text"`` in the output (a documented figure or message)."""
    extra = shlex.split(block.marker.split(" with ", 1)[1]) if " with " in block.marker else []
    code, texts = manual.expected_exit(block), manual.expected_output(block)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    scripts = manual.console_scripts()
    for command in manual.block_commands(block):
        argv = list(command.argv)
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        elif argv[0] == "torchrun":
            argv[:1] = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        elif argv[0] in scripts:
            module, function = scripts[argv[0]].split(":")
            argv[:1] = [sys.executable, "-c", f"import sys; from {module} import {function}; sys.exit({function}())"]
        argv = [os.path.join(ROOT, a) if os.path.isfile(os.path.join(ROOT, a)) and not os.path.isabs(a) else a
                for a in argv]
        if any(a.endswith("pretrain_gpt.py") for a in argv):
            argv += extra  # relative paths (run_dir, checkpoints, caches) land in tmp_path, the working directory
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == code, \
            f"{command} exited {proc.returncode}, not {code}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        missing = [t for t in texts if t not in proc.stdout + proc.stderr]
        assert not missing, f"{command}: {missing} not in its output:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def marked_blocks(kind):
    return [b for rel in manual.manual_files() for b in manual.blocks(rel)
            if b.marker and b.marker.split()[0] == kind]


def test_every_command_block_runs_or_says_why_not():
    """A shell block of commands either runs here (``run``, or ``slow-run`` under ``-m slow``) or carries
    ``not-run (why)``: no documented command is left unchecked without a stated reason."""
    unmarked = []
    for rel in manual.manual_files():
        for b in manual.blocks(rel):
            if b.lang not in manual.SHELL or not manual.block_commands(b):
                continue
            kind = (b.marker or "").split(" ", 1)[0]
            if kind in ("run", "slow-run") or re.fullmatch(r"not-run \(.{10,}\)", b.marker or ""):
                continue
            unmarked.append(f"{b.path}:{b.line} ({b.marker or 'no docs-test marker'})")
    assert not unmarked, ("command blocks that neither run in the docs test nor say why not "
                          "(<!-- docs-test: run -->, slow-run, or not-run (reason)):\n" + "\n".join(unmarked))


@pytest.mark.parametrize("block", marked_blocks("run"), ids=lambda b: f"{b.path}:{b.line}")
def test_cheap_commands_run(block, tmp_path):
    run_block(block, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("block", marked_blocks("slow-run"), ids=lambda b: f"{b.path}:{b.line}")
def test_slow_commands_run(block, tmp_path):
    run_block(block, tmp_path)
