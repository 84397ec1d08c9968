"""``python -m streamkl_ref`` runs the ``streamkl`` command."""
import sys

from .cli import main

sys.exit(main())
