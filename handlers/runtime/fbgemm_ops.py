"""FBGEMM's operators (``torch.ops.fbgemm.*``: the table-batched lookups a graph calls, the jagged
permutes of the coalescer), registered by importing ``fbgemm_gpu``; importing this module is how
the runtime asks for them."""

from handlers.runtime.quiet import quieter

# fbgemm_gpu logs "Successfully loaded: '<library>.so'" on the root logger for each of its ~20
# libraries; a load that fails is logged as an error, which still shows.
with quieter(""):
    import fbgemm_gpu  # noqa: F401
