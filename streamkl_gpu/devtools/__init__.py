"""Tools for developing the kernels, not for running them: the interpreter's bounds and race checks
(``bounds``; public as ``streamkl_gpu.bounds_checked``), the offline sm_90 compile and SASS tool
(``sass``), the diagnostic kernel variants reached through the forcing hook (``diagnostics``) and
the warm ``streamkl verify`` run's compiles against the cold run's (``warm_compiles``)."""
