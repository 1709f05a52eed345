"""`python -m eval RUN_DIR_or_CHECKPOINT ...`: see eval/run.py."""

import sys

from eval.run import main

sys.exit(main())
