"""``python -m effijax`` runs the command line."""

import sys

from effijax.cli import main

sys.exit(main())
