"""The attention KL: ``attention_kl``, its varlen entry, custom ops and autograd, host launch code,
the launch configurations, the Triton kernels (``triton/``) and the Hopper Gluon forward
(``gluon/``). Public names are re-exported by ``streamkl_gpu``; importing this package defines no
kernel (Triton decides at definition time whether to interpret)."""
