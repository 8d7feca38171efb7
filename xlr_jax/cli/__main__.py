"""`python -m xlr_jax.cli`."""
import sys

from xlr_jax.cli.main import main

sys.exit(main())
