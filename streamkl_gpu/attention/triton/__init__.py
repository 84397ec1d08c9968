"""The portable Triton kernels of the attention KL: the forward (``fwd``) and the backward (``bwd``)."""
