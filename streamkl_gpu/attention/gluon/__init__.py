"""The Hopper (sm_90) Gluon kernels of the attention KL: the forward (``fwd_sm90``) and the backward
for one trained side (``bwd_sm90``), each with the rule that chooses it (``dispatch``, ``bwd_dispatch``)."""
