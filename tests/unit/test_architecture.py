"""The package's layers import one way: core -> models -> data -> training -> tools (CLI back-ends).

Every import of every module is checked, function-level (lazy) imports included: a module may import
its own layer and the layers before it, never one after it. Core imports only torch, numpy, the
standard library and itself.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["megand.core", "megand.models", "megand.data", "megand.training", "megand.tools"]
CORE_THIRD_PARTY = {"torch", "numpy", "apex"}  # apex: the optional fused-optimizer fast path


def layer_of(module: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return i
    return None


def imports_of(path: Path, module: str):
    """Every module name imported anywhere in ``path`` (relative imports resolved)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                yield f"{base}.{node.module}" if node.module else base
            else:
                yield node.module


def modules():
    for path in sorted((ROOT / "megand").rglob("*.py")):
        yield path, ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_every_module_is_in_a_layer():
    outside = [m for _, m in modules() if m != "megand" and layer_of(m) is None]
    assert not outside, f"modules outside the layers {LAYERS}: {outside}"


def test_imports_point_one_way():
    upward = []
    for path, module in modules():
        own = layer_of(module)
        for imported in imports_of(path, module):
            target = layer_of(imported)
            if imported.startswith("megand") and (target is None or (own is not None and target > own)):
                upward.append(f"{module} imports {imported}")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_core_imports_only_torch_numpy_and_the_standard_library():
    foreign = []
    for path, module in modules():
        if layer_of(module) != 0:
            continue
        for imported in imports_of(path, module):
            top = imported.split(".")[0]
            if top not in CORE_THIRD_PARTY and top != "megand" and top not in sys.stdlib_module_names:
                foreign.append(f"{module} imports {imported}")
            elif top == "megand" and layer_of(imported) != 0:
                foreign.append(f"{module} imports {imported}")
    assert not foreign, "core must not depend on these:\n" + "\n".join(foreign)


def test_the_checker_sees_lazy_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from megand.training import pretrain\n    import megand.tools.spawn\n")
    assert set(imports_of(probe, "megand.core.probe")) == {"megand.training", "megand.tools.spawn"}
