"""The construction check of stateful layers on our state slots (`check_state_carry`): the
model's own layers, run through the slot wrappers (runner/state_switch.py) in decode steps and
later prefill chunks, must give the logits of one forward over all tokens; and whether later
prefill chunks must run token by token.
"""
from __future__ import annotations

import torch

from cb_kernels.runner.attention import model_lock
from cb_kernels.runner.probe import probe_forward
from cb_kernels.runner.state_cache import StatePool, plan
from cb_kernels.runner.state_switch import StateSwitch
from cb_kernels.runner.support import UnsupportedModelError


class _ProbeSeq:
    """What state_cache.plan reads of a sequence."""

    def __init__(self, start: int):
        self.state_slot = 0
        self.num_computed_tokens = start


def check_state_carry(model, configs, state_layers: dict, specs: dict,
                      num_tokens: int = 10) -> bool:
    """Refuses a model whose stateful layers do not carry their state through our slots the way
    one forward over all tokens does. Three runs through the slot wrappers with the probe's
    attention (zeros), one sequence in a 1-slot pool: all `num_tokens` tokens at once; the first
    n - 1 then the last as a decode; the first half then the rest as a later prefill chunk. The
    last token's logits must agree (up to the rounding of a chunked scan against a step-by-step
    one: 64 ulps of the model's dtype relative to the largest logit): else the layer reads
    something our slots do not give it (e.g. its cache's sequence length), and a step would
    compute other tokens than generate().

    Returns whether later prefill chunks must run token by token: some layers' multi-token path
    starts from zero state even when their cache holds one (Mamba's and Falcon-Mamba's full
    sequence scan takes no initial state in transformers 5.24), while their one-token path
    continues from it; such a model is accepted when the chunk, fed one token at a time,
    matches."""
    name = type(model).__name__
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(num_tokens, device=device) * 5 + 2) % vocab
    pool = StatePool(specs, 1, device)
    switch = StateSwitch(state_layers, pool)

    def run(pieces):
        start, logits = 0, None
        for n in pieces:
            step = plan([_ProbeSeq(start)], [n], device)
            pos = torch.arange(start, start + n, device=device)[None]
            out, _ = probe_forward(model, configs, ids[None, start:start + n], pos, switch,
                                   state=step)
            logits = out.logits[0, -1].float()
            start += n
        return logits

    half = num_tokens // 2
    stepwise = False
    try:
        with model_lock(model), torch.inference_mode():
            whole = run([num_tokens])
            stepped = run([num_tokens - 1, 1])
            chunked = run([half, num_tokens - half])
            scale = whole.abs().max().item()
            tol = 64 * torch.finfo(next(model.parameters()).dtype).eps * scale + 1e-6
            if (chunked - whole).abs().max().item() > tol \
                    and (stepped - whole).abs().max().item() <= tol:
                switch.stepwise = True
                chunked = run([half, num_tokens - half])
                stepwise = True
    except Exception as e:                    # noqa: BLE001
        raise UnsupportedModelError(
            f"{name}'s stateful layers fail when run on cb_kernels' state slots "
            f"({type(e).__name__}: {e})") from e
    for what, got in (("a decode step", stepped), ("a later prefill chunk", chunked)):
        err = (got - whole).abs().max().item()
        if not err <= tol:
            raise UnsupportedModelError(
                f"{name}: its stateful layers continued from cb_kernels' state slots in "
                f"{what} give other logits than one forward over all tokens (max difference "
                f"{err:.3g} of {scale:.3g}): the layers keep state outside transformers' "
                "conv / recurrent cache state")
    return stepwise
