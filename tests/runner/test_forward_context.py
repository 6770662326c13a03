"""runner/forward_context.py: the one per-thread object the hooks inside transformers' forward
read (the step's attention metadata and state split, the probe's recording, the tensor-parallel
flags)."""
import ast
import threading
from pathlib import Path

import pytest

from cb_kernels.runner import forward_context
from cb_kernels.runner.tensor_parallel import local_only

PACKAGE = Path(__file__).resolve().parents[2] / "cb_kernels"


def test_entries_nest_and_restore_also_on_an_error():
    outer = forward_context.current()
    with forward_context.entered(attn="a") as ctx:
        assert forward_context.current() is ctx and ctx.attn == "a" and ctx.state is None
        with forward_context.entered(state="s"), local_only():
            inner = forward_context.current()
            assert (inner.attn, inner.state, inner.tp_local) == ("a", "s", True)
        assert forward_context.current() is ctx
        with pytest.raises(KeyError):
            with forward_context.entered(recording="r"):
                raise KeyError("x")
        assert forward_context.current() is ctx
    assert forward_context.current() is outer
    assert (outer.attn, outer.state, outer.recording, outer.tp_local) == (None, None, None, False)


def test_another_thread_never_sees_this_threads_step():
    seen = {}
    inside, done = threading.Event(), threading.Event()

    def other():
        inside.wait()
        ctx = forward_context.current()
        seen["other"] = (ctx.attn, ctx.state)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with forward_context.entered(attn="step", state="split"):
        inside.set()
        done.wait(10)
    t.join()
    assert seen["other"] == (None, None)


def test_the_runner_keeps_no_other_thread_local():
    """The hooks' per-forward data has one home: the runner makes one threading.local, in
    forward_context.py."""
    found = []
    for path in sorted((PACKAGE / "runner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "local" \
                    and getattr(node.value, "id", "") == "threading":
                found.append(path.relative_to(PACKAGE).as_posix())
    assert found == ["runner/forward_context.py"]
