"""Pipeline schedules as data (docs/DESIGN.md section 3): the IR, builders, validation, lowering to
send/recv, timed simulation and IO. Everything here is a pure function over :class:`Schedule`;
the RLHFuse schedule search, the simulated backend and the real pipeline runtime share it."""
from harness.schedule.builders import (
    build,
    forward_only,
    gpipe,
    merge_sequential,
    one_f_one_b,
    sequential_actor_critic,
)
from harness.schedule.io import (
    ascii_grid,
    from_csv,
    from_csv_string,
    schedule_from_dict,
    schedule_to_dict,
    to_chrome_trace_events,
    to_csv,
    to_csv_string,
)
from harness.schedule.ir import Action, PipeCosts, PipeSpec, Schedule
from harness.schedule.lower import lower, strip_comm
from harness.schedule.simulate import (SimModel, SimResult, list_order_peak_memory, sim_model, simulate, simulate_each,
                                       simulate_makespans)
from harness.schedule.checks import ScheduleError, find_deadlock, validate

__all__ = [
    "Action", "PipeCosts", "PipeSpec", "Schedule",
    "build", "forward_only", "gpipe", "merge_sequential", "one_f_one_b", "sequential_actor_critic",
    "ScheduleError", "find_deadlock", "validate",
    "lower", "strip_comm",
    "SimModel", "SimResult", "list_order_peak_memory", "sim_model", "simulate", "simulate_each", "simulate_makespans",
    "ascii_grid", "from_csv", "from_csv_string", "schedule_from_dict", "schedule_to_dict",
    "to_chrome_trace_events", "to_csv", "to_csv_string",
]
