"""The Triton kernels of the indexer loss: the forward (``fwd``; GQA teachers: ``fwd_gqa``, its
storing form for the chunk design: ``fwd_gqa_store``), the backward (``bwd``), the accumulating
training forward (``accumulate``) and the top-k kernels (``topk``)."""
