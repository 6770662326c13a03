"""WeightWatch: notices when the model's weights change, so the prefix cache never serves KV that
older weights computed (DESIGN.md, "Caches follow the weights").

A parameter's identity is (data_ptr, version counter): an optimizer step, `load_state_dict`,
`p.mul_()` or `p.copy_()` move the counter, `p.data = new` moves the address. Writes that bypass
the counter (`p.data.copy_(...)`, writes to inference tensors) are invisible: after them call
`Engine.weights_updated()`.

Cost: the per-step check walks a list of the parameters kept since the last `refresh_list()`
(a SmolLM2-135M-shaped model's 272 tensors: 0.13 ms on the loaded 2-core bench host, against
59.5 ms for a 16-request decode step there); `refresh_list()` walks the module tree (0.58 ms
there), so the engine runs it once per generate()/stream() call, which also catches a parameter
object replaced by another.
"""
from __future__ import annotations

import torch


def _identity(p: torch.Tensor) -> tuple:
    return (p.data_ptr(), 0 if p.is_inference() else p._version)


class WeightWatch:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params: list = []
        self.refresh_list()
        self.key = [_identity(p) for p in self.params]

    def refresh_list(self) -> None:
        """Take the parameter list again (a module may have got a new Parameter object); the
        next changed() compares against the old identities."""
        self.params = list(self.model.parameters()) if isinstance(self.model, torch.nn.Module) \
            else []

    def changed(self) -> bool:
        """Whether any parameter was replaced or written (through torch) since the last call."""
        key = [_identity(p) for p in self.params]
        if key == self.key:
            return False
        self.key = key
        return True
