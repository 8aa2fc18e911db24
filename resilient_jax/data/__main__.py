"""Entry point: `python -m resilient_jax.data ...` (see `cli`)."""

import sys

from resilient_jax.data.cli import main

sys.exit(main())
