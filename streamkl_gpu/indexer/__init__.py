"""The sparse-attention indexer loss: ``indexer_kl``, ``indexer_kl_topk``, their custom ops, host
code, launch configurations, training designs and Triton kernels (``triton/``). Public names are
re-exported by ``streamkl_gpu``; importing this package defines no kernel."""
