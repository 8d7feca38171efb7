"""The `xlr` command line."""
from xlr_jax.cli.main import main

__all__ = ["main"]
