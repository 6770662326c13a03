"""Every family the fused CPU forward serves: each module here defines SPECS (a list of
FamilySpec); `spec_for(model_type)` finds one."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Optional

from cb_kernels.runner.fused.spec import FamilySpec


def _load() -> dict:
    specs = {}
    for info in pkgutil.iter_modules(__path__):
        for spec in importlib.import_module(f"{__name__}.{info.name}").SPECS:
            specs[spec.model_type] = spec
    return specs


SPECS: dict = _load()


def spec_for(model_type) -> Optional[FamilySpec]:
    return SPECS.get(model_type)
