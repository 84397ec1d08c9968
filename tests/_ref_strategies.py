"""Moved: the strategies and float64 tolerances live in :mod:`streamkl_ref.strategies` (public,
one home). This name stays for test files on other branches that still import it."""
from streamkl_ref.strategies import *  # noqa: F401,F403
from streamkl_ref.strategies import __all__  # noqa: F401
