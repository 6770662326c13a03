"""What the fused CPU forward needs to know about one model family.

A decoder-only family whose layers are pre-norm RMSNorm -> attention (rotary) -> RMSNorm -> gated
MLP fits the fused forward (forward.py); a spec names its modules and says how its projections
are laid out. Adding a family is one file in families/ that defines `SPECS` (a list of
FamilySpec), plus tests that compare its logits with transformers' forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


def no_window(attn) -> Optional[int]:
    return None


@dataclass(frozen=True)
class FamilySpec:
    """model_type: `config.model_type`; the modules must come from that family's own
    transformers modeling file (`transformers.models.<model_type>.modeling_<model_type>`).

    qkv: the attention input projections, in q, k, v order: three modules (packed into one
    fused weight by PackedLinears) or one module whose output is q | k | v.
    gate_up: the MLP's gate and up projections: two modules, or one whose output is gate | up.
    qk_norm: an RMSNorm per head on q and k before rotary (`q_norm`, `k_norm`), as Qwen3.
    sliding_window: the layer's window (keys including the query) from its attention module.
    """

    model_type: str
    qkv: tuple = ("q_proj", "k_proj", "v_proj")
    o_proj: str = "o_proj"
    gate_up: tuple = ("gate_proj", "up_proj")
    down_proj: str = "down_proj"
    act: str = "act_fn"
    attn: str = "self_attn"
    mlp: str = "mlp"
    input_norm: str = "input_layernorm"
    post_attention_norm: str = "post_attention_layernorm"
    qk_norm: bool = False
    sliding_window: Callable = no_window

    @property
    def modeling_module(self) -> str:
        return f"transformers.models.{self.model_type}.modeling_{self.model_type}"
