"""`python -m mlx_dspark` runs the CLI."""

import sys

from mlx_dspark.entrypoints.cli import main

sys.exit(main())
