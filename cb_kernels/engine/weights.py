"""WeightWatch: notices when the model's weights change, so no step computes with, and no cache
serves, weights the engine has not seen (DESIGN.md, "Caches follow the weights").

Two detectors, both cheap enough for every step:
- a Parameter object put in place of another (`module.weight = nn.Parameter(...)`,
  `load_state_dict(..., assign=True)`, a new submodule): torch's global parameter- and
  module-registration hooks raise a flag, and only then is the module tree walked again;
- a parameter written or re-pointed (an optimizer step, `mul_`, `load_state_dict` without
  assign, `p.data = t`): its (data_ptr, version counter) pair, compared each step over the kept
  list;
- an optimizer step over any of the model's parameters: torch's global optimizer step hook raises
  a flag. The fused optimizers (`AdamW(fused=True)`, transformers Trainer's default
  `adamw_torch_fused`) write the parameters without bumping their version counters (torch 2.13),
  so the pair above alone would miss every step of a TRL/Trainer training loop.
Writes that move none of these (`p.data.copy_(...)`, writes to inference tensors) are invisible: after
them call `Engine.weights_updated()`.

Cost per step (the compare; the flag is one attribute read), bench/bench_weight_watch.py on the
2-core Zen 4 (AVX-512, VNNI, AVX512-BF16), 2 threads, load ~2: 0.034 ms for a SmolLM2-135M-shaped
model's 272 tensors, 0.12% of its 27.6 ms 16-request fp32 decode step; 0.067 ms (0.06%) for a
48-layer Qwen3-MoE's 531; walking the module tree every step instead would cost 0.40 / 0.70 ms.
"""
from __future__ import annotations

import operator
import weakref

import torch
from torch.nn.modules import module as nn_module
from torch.optim.optimizer import register_optimizer_step_post_hook


# The per-step key is two C-level maps (addresses of every parameter, version counters of those
# that keep one), not a Python call per parameter: 2.2-2.4x cheaper (272 parameters: 0.031 vs
# 0.067 ms; 5000: 0.64 vs 1.57 ms; 1 thread, Zen 4, load ~2).
_data_ptr = torch.Tensor.data_ptr
_version = operator.attrgetter("_version")


def _flag_on_registration(watch: "WeightWatch") -> list:
    """torch's global hooks: registrations raise `watch.replaced`, an optimizer step over one of
    the model's parameters raises `watch.stepped`; removed when `watch` dies. Registrations fire
    for every module of the process (another model being built too): a false alarm costs one walk
    of this model's tree, and the identities decide whether anything changed."""
    ref = weakref.ref(watch)

    def hook(module, *_):
        # Only registrations into this model's tree: transformers' decoders slice their
        # ModuleList every forward (`self.layers[:n]` builds a new one, registering each layer
        # in it), which flagged a walk of the whole tree every step (0.21 ms a step on a 4-layer
        # bench model; more per layer).
        w = ref()
        if w is not None and id(module) in w.module_ids:
            w.replaced = True

    def stepped(optimizer, *_):
        w = ref()
        if w is not None and not w.stepped:
            ours = w.param_ids
            w.stepped = any(id(p) in ours for g in optimizer.param_groups for p in g["params"])
    handles = [nn_module.register_module_parameter_registration_hook(hook),
               nn_module.register_module_module_registration_hook(hook),
               register_optimizer_step_post_hook(stepped)]
    weakref.finalize(watch, lambda: [h.remove() for h in handles])
    return handles


class WeightWatch:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params: list = []
        self.key: tuple = ()
        self.replaced = True          # walk the tree at the next check
        self.stepped = False          # an optimizer stepped over our parameters since the check
        self.param_ids: set = set()
        self.tracked: list = []       # the parameters that keep a version counter
        self.optimizer_stepped = False    # the last change came with an optimizer step
        self.modules: list = []
        self.module_ids: set = set()  # ids of `modules` (held there, so never reused)
        self.modules_moved = False    # the last change put a submodule in place of another
        if isinstance(model, torch.nn.Module):
            _flag_on_registration(self)
        self.changed()

    def changed(self) -> bool:
        """Whether any parameter was replaced or written (through torch) since the last call."""
        moved = self.modules_moved = False
        if self.replaced:
            self.replaced = False
            if isinstance(self.model, torch.nn.Module):
                modules = list(self.model.modules())
                self.modules_moved = bool(self.modules) and (
                    len(modules) != len(self.modules)
                    or any(a is not b for a, b in zip(modules, self.modules)))
                self.modules = modules
                self.module_ids = {id(m) for m in modules}
            params = list(self.model.parameters()) \
                if isinstance(self.model, torch.nn.Module) else []
            # The old objects were held until now, so a new one cannot reuse an old address.
            moved = len(params) != len(self.params) or \
                any(a is not b for a, b in zip(params, self.params))
            self.params = params
            self.param_ids = {id(p) for p in params}
            self.tracked = [p for p in params if not p.is_inference()]
        stepped, self.stepped = self.stepped, False
        self.optimizer_stepped = stepped   # the runner's own version checks cannot see it
        key = self._key()
        if key == self.key and not moved and not stepped:
            return False
        self.key = key
        return True

    def _key(self) -> tuple:
        """(every parameter's data_ptr, the version counter of each that keeps one)."""
        try:
            return list(map(_data_ptr, self.params)), list(map(_version, self.tracked))
        except RuntimeError:     # one became an inference tensor (`p.data = t` under no version)
            self.tracked = [p for p in self.params if not p.is_inference()]
            return list(map(_data_ptr, self.params)), list(map(_version, self.tracked))
