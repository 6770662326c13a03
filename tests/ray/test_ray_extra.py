"""cb_kernels.ray is an optional extra: without Ray, importing it names the extra to install."""
import importlib
import sys

import pytest


def test_import_without_ray_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "ray" or m.startswith(("ray.", "cb_kernels.ray"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)        # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'cb_kernels\[ray\]'"):
        importlib.import_module("cb_kernels.ray")
