"""amdqb's benchmark library (``amdqb bench SUITE`` / ``python -m amdqb bench SUITE``), installed
with the package; its results files live in the repository (``bench/results``).

Importing this package loads nothing but the suite descriptions below (``amdqb --help`` lists
them); the suites themselves are ``amdqb.bench.cli.SUITES``.
"""

# One description per suite (and "all"), the text of ``amdqb --help`` and ``amdqb bench --help``.
SUITE_HELP = {
    "route": "moe_route_rows (atomic / lds / deterministic) and moe_align_block_size vs torch",
    "router": "fused router: no QB, QB uniform / log_margin / tie-free in each mode; biased_topk",
    "chunks": "moe_sort_chunks_and_pad + moe_unpad_and_restore_chunks round trip vs split/cat",
    "balance": "QuantileBalancer.step() (recover, EMA, centre, bounds, zero)",
    "serving": "routing share of a serving MoE layer (biased_topk + align), eager and graph",
    "compat": "vLLM / SGLang routers and align at the peers' shapes, and the launch floor",
    "all": "every suite above, in that order",
}
