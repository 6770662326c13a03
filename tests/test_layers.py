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


def _bad_imports(me: str, imports) -> list:
    """The (line, target) imports of module `me` that go up a layer, or reach below the public
    ops API from above it."""
    mine = _layer(me)
    bad = []
    for line, target in imports:
        theirs = _layer(target)
        if 0 < theirs < mine or (mine > 0 and theirs == 0):
            bad.append(f"line {line}: {me} ({LAYERS[mine]}) imports {target} ({LAYERS[theirs]})")
        parts = target.split(".")
        if mine < LAYERS.index("ops") and mine != 0:
            if parts[1:2] == ["_C"] or (parts[1:2] == ["ops"] and len(parts) > 2
                                         and parts[2].startswith("_")):
                bad.append(f"line {line}: {me} reaches below the public ops API: {target}")
    return bad


@pytest.mark.parametrize("path", MODULES, ids=[_module_name(p) for p in MODULES])
def test_imports_only_go_down(path):
    bad = _bad_imports(_module_name(path), _imports(path))
    assert not bad, "\n".join(bad)


def test_the_rule_catches_an_upward_import(tmp_path):
    """The checker itself: an engine module importing the drop-in or a top-level module, a
    runner module importing the engine, calling _C or a private ops module, are all reported;
    imports down a layer are not."""
    fake = tmp_path / "mod.py"
    fake.write_text("from cb_kernels import _C, ops\nimport cb_kernels.hf.dropin\n"
                    "from cb_kernels.engine.config import EngineConfig\n"
                    "from cb_kernels.ops._backend import pick\n"
                    "def f():\n    from cb_kernels.serve import server\n")
    imports = list(_imports(fake))
    assert [t for _, t in imports] == ["cb_kernels._C", "cb_kernels.ops", "cb_kernels.hf.dropin",
                                       "cb_kernels.engine.config", "cb_kernels.ops._backend",
                                       "cb_kernels.serve"]
    assert _bad_imports("cb_kernels.runner.fake", imports) == [
        "line 1: cb_kernels.runner.fake reaches below the public ops API: cb_kernels._C",
        "line 2: cb_kernels.runner.fake (runner) imports cb_kernels.hf.dropin (hf)",
        "line 3: cb_kernels.runner.fake (runner) imports cb_kernels.engine.config (engine)",
        "line 4: cb_kernels.runner.fake reaches below the public ops API: "
        "cb_kernels.ops._backend",
        "line 6: cb_kernels.runner.fake (runner) imports cb_kernels.serve (<top>)"]
    assert _bad_imports("cb_kernels.serve.fake", imports) == []     # the top may import any
    assert _bad_imports("cb_kernels.ops.fake", [imports[1], imports[4]]) == []   # its own


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


# -- the engine's parts and the runner contract ---------------------------------------------------
# A sample group and its sequences point at each other by design (data, not a part).
ENGINE_AND_RUNNER = [p for p in MODULES if _layer(_module_name(p)) in (LAYERS.index("engine"),
                                                                    LAYERS.index("runner"))
                     and _module_name(p) != "cb_kernels.engine.sequence"]
# The runner's callers: the engine and the entry points (the kernel microbenchmarks hold no runner).
RUNNER_CALLERS = [p for p in MODULES if _layer(_module_name(p)) in (0, LAYERS.index("engine"))
                  and not _module_name(p).startswith("cb_kernels.benchmarks")]


def _back_references(path: Path) -> list:
    """Where a module hands an object to a part that keeps it as its owner: a class built with
    `self` among its arguments (`Pipeline(self)`), an `__init__` taking an `engine`, or an
    attribute `.engine` assigned."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else \
                getattr(node.func, "id", "")
            args = list(node.args) + [k.value for k in node.keywords]
            if callee[:1].isupper() and any(isinstance(a, ast.Name) and a.id == "self"
                                            for a in args):
                bad.append(f"line {node.lineno}: {callee}(self, ...)")
        elif isinstance(node, ast.FunctionDef) and node.name == "__init__":
            if any(a.arg == "engine" for a in node.args.args + node.args.kwonlyargs):
                bad.append(f"line {node.lineno}: __init__ takes an engine")
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and t.attr == "engine":
                    bad.append(f"line {node.lineno}: .engine assigned")
    return bad


def _runner_expr(node) -> bool:
    """`runner`, `r` or `<anything>.runner`: how the engine names its runner."""
    return (isinstance(node, ast.Name) and node.id in ("runner", "r")) or \
        (isinstance(node, ast.Attribute) and node.attr == "runner")


def _runner_contract() -> set:
    """What runner/base.py declares: ModelRunner's members, and TensorParallelRunner's (read only
    where the engine holds a tensor-parallel runner)."""
    from cb_kernels.runner.base import ModelRunner, TensorParallelRunner

    return {n for proto in (ModelRunner, TensorParallelRunner)
            for n in set(proto.__annotations__) | set(vars(proto)) if not n.startswith("_")}


def _runner_reads(path: Path, contract: set) -> list:
    """getattr/hasattr on a runner (a default outside the contract), and attributes of a runner
    that the ModelRunner protocol does not declare."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr") \
                and node.args and _runner_expr(node.args[0]):
            bad.append(f"line {node.lineno}: {node.func.id}(runner, ...)")
        elif isinstance(node, ast.Attribute) and _runner_expr(node.value) \
                and node.attr not in contract:
            bad.append(f"line {node.lineno}: runner.{node.attr} is not in ModelRunner")
    return bad


@pytest.mark.parametrize("path", ENGINE_AND_RUNNER, ids=[_module_name(p) for p in ENGINE_AND_RUNNER])
def test_no_part_holds_a_reference_to_its_owner(path):
    bad = _back_references(path)
    assert not bad, f"{_module_name(path)}:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", RUNNER_CALLERS, ids=[_module_name(p) for p in RUNNER_CALLERS])
def test_the_runner_is_read_only_through_its_contract(path):
    bad = _runner_reads(path, _runner_contract())
    assert not bad, f"{_module_name(path)}:\n" + "\n".join(bad)


def test_the_contract_checks_catch_what_they_forbid(tmp_path):
    """The checkers themselves: a part built with the Engine, an __init__ taking an engine, a
    getattr default on the runner and an undeclared runner attribute are all reported."""
    fake = tmp_path / "mod.py"
    fake.write_text(
        "class Engine:\n"
        "    def __init__(self):\n"
        "        self.pipeline = OverlapPipeline(self)\n"
        "        n = getattr(self.runner, 'state_bytes_per_seq', 0)\n"
        "        w = self.runner.sliding_windows_of_my_own\n"
        "        t = self.runner.k_caches\n"
        "class Part:\n"
        "    def __init__(self, engine):\n"
        "        self.engine = engine\n")
    assert len(_back_references(fake)) == 3
    reads = _runner_reads(fake, _runner_contract())
    assert reads == ["line 4: getattr(runner, ...)",
                     "line 5: runner.sliding_windows_of_my_own is not in ModelRunner"]


def test_the_greedy_walk_opens_at_most_ten_files():
    """docs/ARCHITECTURE.md's walk of one greedy request, generate() to the CPU attention kernel:
    the files it opens exist, and there are at most 10 of them (issue #26)."""
    import re

    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    m = re.search(r"The walk opens (\d+) package files: (.*?)\.\n", text, re.S)
    assert m, "docs/ARCHITECTURE.md no longer states the walk's files"
    names = [n.strip() for n in re.split(r"[,;]", m.group(2).replace("\n", " "))]
    assert len(names) == int(m.group(1)) <= 10, names
    roots = {"engine": PACKAGE, "runner": PACKAGE, "ops": PACKAGE, "python": PACKAGE.parent,
             "csrc": PACKAGE.parent}
    missing = [n for n in names if not (roots[n.split("/")[0]] / n).is_file()]
    assert not missing, missing


SOURCE_LIMIT = 600


def _long_files(root: Path, limit: int = SOURCE_LIMIT) -> list:
    """Source files (.py, .h, .cpp, .cu, .cuh) under `root` longer than `limit` lines."""
    return [f"{p.relative_to(root)}: {n} lines" for p in sorted(root.rglob("*"))
            if p.suffix in (".py", ".h", ".cpp", ".cu", ".cuh") and "__pycache__" not in p.parts
            and (n := len(p.read_text().splitlines())) > limit]


def test_no_source_file_over_600_lines(tmp_path):
    """Small single-purpose files (issue #26: no package, binding or kernel file over 600
    lines). The checker itself reports a 601-line file and passes a 600-line one."""
    root = PACKAGE.parent
    long = [f for d in ("cb_kernels", "csrc", "python") for f in _long_files(root / d)]
    assert not long, long
    (tmp_path / "a.py").write_text("x = 1\n" * 600)
    (tmp_path / "b.cpp").write_text("int x;\n" * 601)
    assert _long_files(tmp_path) == ["b.cpp: 601 lines"]
