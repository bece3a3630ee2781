"""The peers' own module surfaces as thin translations onto amdqb's ops, so that switching a code
path to amdqb is an import change:

* ``amdqb.compat.te``: TransformerEngine's ``transformer_engine.pytorch.router``;
* ``amdqb.compat.vllm``: vLLM's ``fused_topk``, ``fused_topk_bias``, ``grouped_topk``,
  ``moe_align_block_size`` and ``_custom_ops.moe_align_block_size``;
* ``amdqb.compat.sglang``: SGLang's ``moe_align_block_size``, ``moe_fused_gate``,
  ``biased_grouped_topk`` and ``kimi_k2_moe_fused_gate``.
"""
