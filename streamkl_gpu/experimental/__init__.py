"""Kernels that are not the default anywhere and run only when forced: the Hopper Gluon backward of
the attention KL (``STREAMKL_BWD_BACKEND=gluon``), paired with the Triton path it is checked against."""
