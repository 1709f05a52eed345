"""`python -m eval RUN_DIR_or_CHECKPOINT ...`: see eval/run.py."""

from eval.run import main
from moe_lc.parallel.mesh import exit_process

exit_process(main())
