"""The Hopper (sm_90) Gluon kernels of the attention KL: the forward (``fwd_sm90``, host side
``fwd_sm90_launch``) and the backward (``bwd_sm90``, host side ``bwd_sm90_launch``), each with the
rule that chooses it (``dispatch``, ``bwd_dispatch``)."""
