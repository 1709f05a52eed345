"""`python -m eval RUN_DIR_or_CHECKPOINT ...`: see eval/run.py."""

import os

from eval.run import main
from moe_lc.parallel.mesh import exit_process

exit_process(main(), distributed=int(os.environ.get("WORLD_SIZE", "1")) > 1)
