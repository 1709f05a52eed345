"""`python -m eval RUN_DIR_or_CHECKPOINT ...`: see eval/run.py."""

from .run import cli

cli()
