"""phi3 (Phi-3 / Phi-3.5-mini, Phi-4-mini; transformers Phi3ForCausalLM) on the shared decoder.

What is new is only the checkpoint layout: q/k/v live in one `self_attn.qkv_proj` ([q; k; v]
rows) and gate/up in one `mlp.gate_up_proj` ([gate; up] rows). Our packed layers split them over
ranks by KV group and by intermediate columns, so each fused tensor is presented as its parts,
row ranges of it (loading/fused.py): a rank still reads only its own rows. The rest is config:

- `partial_rotary_factor` (Phi-4-mini: in `rope_parameters`, or top-level in older configs)
  rotates the first int(head_dim * factor) dims of each head.
- `sliding_window` (Phi-3-mini-4k: 2047) applies to every layer, as transformers' Phi3 does
  (a null window: none).
- rope: `longrope` (also spelled "su", and "yarn", which transformers' Phi3Config renames to
  longrope); the pretraining length is the top-level `original_max_position_embeddings`,
  transformers' Phi3 default 4096 when the config.json lacks it.
- no biases anywhere.
"""

from __future__ import annotations

from typing import Any

from celerytp.loading.checkpoint import Checkpoint
from celerytp.loading.fused import UnfusedCheckpoint
from celerytp.models.base import Progress
from celerytp.models.config import common_fields
from celerytp.models.decoder import DecoderForCausalLM
from celerytp.models.dense_archs import every_layer_window

PHI3_ORIGINAL_MAX_POSITIONS = 4096  # Phi3Config.original_max_position_embeddings' default


def phi3_fields(d: dict[str, Any]) -> dict[str, Any]:
    d = dict(d)
    key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    rope = dict(d.get(key) or {})
    if rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
        rope.pop("type", None)
        d[key] = rope | {"rope_type": "longrope"}
    if d.get("original_max_position_embeddings") is None:
        d["original_max_position_embeddings"] = PHI3_ORIGINAL_MAX_POSITIONS
    fields = common_fields(d)
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    rotary = int(fields["head_dim"] * partial + 1e-6)  # transformers' int(); 0.75 of a GGUF's 24/32 stays 24
    no_bias = {"attention_bias": False, "o_proj_bias": False, "mlp_bias": False}
    return fields | every_layer_window(d) | no_bias | {"rotary_dim": None if rotary == fields["head_dim"] else rotary}


class Phi3ForCausalLM(DecoderForCausalLM):
    """The shared decoder, loading Phi-3's fused qkv_proj / gate_up_proj row ranges."""

    def fused_rows(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Each fused module's parts and their rows, in the checkpoint's row order."""
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        return {
            "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            "gate_up_proj": (("gate_proj", inter), ("up_proj", inter)),
        }

    def load_weights(self, checkpoint: Checkpoint, progress: Progress | None = None) -> set[str]:
        """Loads through the fused tensors' parts; the names returned are the parts' (as
        checkpoint_table lists them). A checkpoint already split (q_proj, ...) loads as it is."""
        return super().load_weights(UnfusedCheckpoint(checkpoint, self.fused_rows()), progress)
