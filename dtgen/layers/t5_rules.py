"""The UMT5 text encoder's tensor-parallel rules (its parameter names are dtgen/layers/t5.py's),
for the plans of any model whose text encoder it is. Torch-free: reading plans loads no model code."""
from __future__ import annotations

from dtgen.plan import Output, Rule


def tp_rules(prefix: str) -> tuple[dict[str, Rule], dict[str, Output]]:
    """The encoder's tensor-parallel rules for its weights under `prefix` (a pipeline's
    "text_encoder."): each parameter's rule (dtgen/plan.py), and the modules whose outputs are
    partial sums. Attention splits by heads, the gated FFN by its hidden columns."""
    layer = prefix + "encoder.block.*.layer."
    params = {
        prefix + "shared.weight": Rule.REPLICATE,
        layer + "0.layer_norm.weight": Rule.REPLICATE,
        layer + "0.SelfAttention.q.weight": Rule.COLUMN,
        layer + "0.SelfAttention.k.weight": Rule.COLUMN,
        layer + "0.SelfAttention.v.weight": Rule.COLUMN,
        # [buckets, heads]: split on its last dim into the same head blocks as q (a slicing rule:
        # its output is per head, not a partial sum, so it has no entry in the outputs).
        layer + "0.SelfAttention.relative_attention_bias.weight": Rule.ROW,
        layer + "0.SelfAttention.o.weight": Rule.ROW,
        layer + "1.layer_norm.weight": Rule.REPLICATE,
        layer + "1.DenseReluDense.wi_0.weight": Rule.COLUMN,
        layer + "1.DenseReluDense.wi_1.weight": Rule.COLUMN,
        layer + "1.DenseReluDense.wo.weight": Rule.ROW,
        prefix + "encoder.final_layer_norm.weight": Rule.REPLICATE,
    }
    return params, {layer + "0.SelfAttention.o": Output.PARTIAL_SUM, layer + "1.DenseReluDense.wo": Output.PARTIAL_SUM}
