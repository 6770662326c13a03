"""The layer rule of DESIGN.md, read off the imports: every module of cb_kernels imports only its
own layer and the layers below it, and nothing above the kernels reaches into _C or a private
ops module (the hot-path entry points are public under cb_kernels.ops)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cb_kernels"
# Top to bottom; a module's layer is its first path component under cb_kernels/.
LAYERS = ["<top>", "hf", "engine", "runner", "ops", "triton", "_C"]


def _layer(module: str) -> int:
    parts = module.split(".")
    if parts[0] != "cb_kernels":
        raise ValueError(module)
    if len(parts) == 1:
        return 0
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else 0


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path):
    """(line, imported module) of every cb_kernels import, inside functions too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "cb_kernels":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "cb_kernels":
            # `from cb_kernels import ops` imports the submodule cb_kernels.ops.
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield node.lineno, sub if node.module == "cb_kernels" else node.module


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_package_has_every_layer():
    names = {_module_name(p) for p in MODULES}
    for layer in ("hf", "engine", "runner", "ops", "triton"):
        assert f"cb_kernels.{layer}" in names


@pytest.mark.parametrize("path", MODULES, ids=[_module_name(p) for p in MODULES])
def test_imports_only_go_down(path):
    me = _module_name(path)
    mine = _layer(me)
    bad = []
    for line, target in _imports(path):
        theirs = _layer(target)
        if 0 < theirs < mine or (mine > 0 and theirs == 0):
            bad.append(f"line {line}: {me} ({LAYERS[mine]}) imports {target} ({LAYERS[theirs]})")
        parts = target.split(".")
        if mine < LAYERS.index("ops") and mine != 0:
            if parts[1:2] == ["_C"] or (parts[1:2] == ["ops"] and len(parts) > 2
                                         and parts[2].startswith("_")):
                bad.append(f"line {line}: {me} reaches below the public ops API: {target}")
    assert not bad, "\n".join(bad)


def test_the_rule_catches_an_upward_import(tmp_path):
    """The checker itself: an engine module importing the drop-in, or a runner module calling
    _C, is reported."""
    assert _layer("cb_kernels.hf.dropin") < _layer("cb_kernels.engine.engine")
    assert _layer("cb_kernels.runner.lm_head") < _layer("cb_kernels.ops")
    fake = tmp_path / "mod.py"
    fake.write_text("from cb_kernels import _C, ops\nimport cb_kernels.hf.dropin\n")
    assert [t for _, t in _imports(fake)] == ["cb_kernels._C", "cb_kernels.ops",
                                             "cb_kernels.hf.dropin"]


def test_csrc_includes_no_torch_or_python_header():
    """The kernels take raw pointers: one build serves every torch version (DESIGN.md, Build)."""
    import re

    csrc = PACKAGE.parent / "csrc"
    bad = []
    for path in sorted(csrc.rglob("*")):
        if path.suffix not in (".h", ".cpp", ".cu", ".cuh"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r'\s*#\s*include\s*[<"]([^>"]+)[>"]', line)
            if m and re.match(r"(torch|ATen|c10|caffe2|pybind11)/|Python\.h$", m.group(1)):
                bad.append(f"{path.relative_to(csrc)}:{n}: {m.group(1)}")
    assert not bad, "\n".join(bad)
