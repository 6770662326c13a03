"""The LM head of an fp32 model on CPU through a weight packed once for oneDNN.

Why: torch's F.linear goes to MKL, which takes a slow path on the AMD bench machine for the
head's shape (few rows, a wide vocab). Measured there, 2 threads, fp32, per call:
  tiny Llama head 32000 x 256, 32 rows:   F.linear 32.1 ms, packed 8.6 ms
  SmolLM2-135M head 49152 x 576, 16 rows: F.linear 23.8 ms, packed 7.1 ms
(MKL_ENABLE_INSTRUCTIONS=AVX512 set before start-up also brings F.linear to 8.7 ms, but that is
the user's environment, not ours to set.) The head is most of a decode step's time on small
models, so the engine runs the decoder itself and projects only the sampled rows with the
packed weight. Only model types whose forward is exactly "decoder, then lm_head on the kept
rows" qualify (no logit scaling or softcapping); others keep model.forward.
"""
from __future__ import annotations

from typing import Optional

import torch

PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def _supported() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedHead:
    """Decoder + packed LM head for one model; `build` returns None when the model does not
    qualify (not CPU fp32, not a plain-head model type, no oneDNN)."""

    def __init__(self, decoder, head: torch.nn.Linear):
        self.decoder, self.head = decoder, head
        self._key = None
        self._packed: Optional[torch.Tensor] = None

    @classmethod
    def build(cls, model) -> Optional["PackedHead"]:
        cfg = model.config
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if getattr(cfg, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES or not _supported() \
                or not isinstance(head, torch.nn.Linear) or head.weight.device.type != "cpu" \
                or head.weight.dtype != torch.float32 or not hasattr(model, "get_decoder"):
            return None
        decoder = model.get_decoder()
        if decoder is None or decoder is model:
            return None
        return cls(decoder, head)

    def _weight(self) -> torch.Tensor:
        w = self.head.weight
        # Repack when the weight is replaced or changed in place (load_state_dict, tying).
        key = (w.data_ptr(), w._version)
        if key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 32)
            self._key = key
        return self._packed

    def __call__(self, input_ids, position_ids, logits_indices, **kwargs) -> torch.Tensor:
        """input_ids, position_ids: int64 [1, T]; logits_indices: int64 [S].
        Returns logits [S, vocab_size]."""
        hidden = self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                              **kwargs).last_hidden_state
        rows = hidden[0].index_select(0, logits_indices)
        bias = self.head.bias
        return torch.ops.mkldnn._linear_pointwise(rows, self._weight(),
                                                  None if bias is None else bias.detach(),
                                                  "none", [], "")
