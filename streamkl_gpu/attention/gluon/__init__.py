"""The Hopper (sm_90) Gluon forward of the attention KL (``fwd_sm90``) and the rule that chooses it
(``dispatch``)."""
