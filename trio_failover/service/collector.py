"""The cyclic garbage collector of a process that only serves (issue 33).

Under churn each stream's objects (its tasks and their coroutines, h11
state, cancel scopes, events: about 180 per stream) live for seconds, so
they survive the two young generations and reach the oldest one, and
CPython then collects the oldest generation every tenth collection of the
middle one: at 500 streams about every 4 s, each time walking every object
of the process while nothing else runs (45 to 90 ms of CPU, measured with
``scripts/bench_stages.py --steps``), which every running stream sees as a
late chunk and every new one as a late first byte. Those collections freed
next to nothing (26 objects in 9 s; the young ones none): the proxy's
objects are freed by their reference counts.

So a serving process freezes what its start built (modules, the settings:
never garbage, never walked again) and collects its oldest generation ten
times less often. The young generations keep their thresholds: they are
quick (0.1 and 3 to 5 ms) and still free any young cycle. Only
``run_server`` calls this: an embedder's process and its collector are its
own.
"""

from __future__ import annotations

import gc

__all__ = ["OLDEST_EVERY", "tune_collector"]

# Collections of the middle generation between two of the oldest (CPython's
# default: 10). The oldest is still collected only once a quarter of its
# objects is new since its last collection.
OLDEST_EVERY = 100


def tune_collector() -> None:
    """Collect, freeze the survivors, and collect the oldest generation every OLDEST_EVERY."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, OLDEST_EVERY)
