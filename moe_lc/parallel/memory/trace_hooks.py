"""What the runtime tells a trace on the meta device (the planner's block trace, tools/planner/block_trace.py; the dry
run, tools/dryrun.py) that counting the tensors it allocates cannot see. Three events:

  host_work   context factories entered around host-side work: an offloaded optimizer's CPU update
              (zero/host_step.py), whose allocations are host memory, not the device's
  offloaded   book(t) for each saved tensor sent to host memory (activation offloading, offload.py)
  resized     fn(t) after a storage was resized in place (ZeRO-3's gathers and frees, param_gather.py),
              which allocate no new tensor

Outside a trace nothing watches and each call costs a dict lookup.
"""

from __future__ import annotations

import contextlib

_WATCHERS: dict[str, list] = {"host_work": [], "offloaded": [], "resized": []}


@contextlib.contextmanager
def watch(event: str, fn):
    """Within: fn is told of `event` (one of _WATCHERS)."""
    _WATCHERS[event].append(fn)
    try:
        yield
    finally:
        _WATCHERS[event].remove(fn)


def tell(event: str, *args) -> None:
    for fn in _WATCHERS[event]:
        fn(*args)


@contextlib.contextmanager
def on_host():
    """Within: host-side work, inside every watching `host_work` context."""
    with contextlib.ExitStack() as stack:
        for factory in _WATCHERS["host_work"]:
            stack.enter_context(factory())
        yield
