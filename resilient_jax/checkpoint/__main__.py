import sys

from resilient_jax.checkpoint.cli import main

sys.exit(main())
