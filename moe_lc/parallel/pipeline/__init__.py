"""Pipeline parallelism: schedules as data (builders, IR, comm insertion, validation) and a simulator.

    schedule = build_schedule("dualpipe", pp=8, m=20)   # validated per-rank action lists
    result = simulate(schedule, Costs(F=1, B=2, W=1, FB=2.5))

See schedule_ir.py for the action semantics a runtime must implement.
"""
from moe_lc.parallel.pipeline.comm_insertion import assemble, ideal_timeline, insert_comm
from moe_lc.parallel.pipeline.dualpipe import dualpipe, dualpipev
from moe_lc.parallel.pipeline.schedule_ir import (
    B, F, FB, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, CommGroup, Compute, P2P, Route, Schedule,
    compute_parts, validate,
)
from moe_lc.parallel.pipeline.schedules import (
    SCHEDULE_NAMES, build_schedule, gpipe, interleaved_1f1b, one_f_one_b, zb_h1,
)
from moe_lc.parallel.pipeline.simulator import Costs, Interval, Published, SimResult, published_figures, simulate

__all__ = [
    "Action", "B", "CommGroup", "Compute", "Costs", "F", "FB", "Interval", "P2P", "Published", "RECV_B",
    "RECV_F", "Route", "SCHEDULE_NAMES", "SEND_B", "SEND_F", "Schedule", "SimResult", "W", "assemble",
    "build_schedule", "compute_parts", "dualpipe", "dualpipev", "gpipe", "ideal_timeline", "insert_comm",
    "interleaved_1f1b", "one_f_one_b", "published_figures", "simulate", "validate", "zb_h1",
]
