"""The Triton kernels of the indexer loss: the forward (``fwd``; GQA teachers: ``fwd_gqa``), the
backward (``bwd``), the accumulating training forward (``accumulate``) and the top-k kernels (``topk``)."""
