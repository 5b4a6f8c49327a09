"""Schedule core: IR, builders, simulator, lowering, plots."""
from .builders import BUILDERS, build, names
from .costs import Costs, Overheads
from .ir import (Action, Kind, Schedule, ScheduleError, interleaved_placement,
                 sequential_placement, v_placement, validate)
from .lower import lower
from .simulator import DeadlockError, SimResult, simulate

__all__ = ["Action", "BUILDERS", "Costs", "DeadlockError", "Kind", "Overheads", "Schedule", "ScheduleError",
           "SimResult", "build", "interleaved_placement", "lower", "names",
           "sequential_placement", "simulate", "v_placement", "validate"]
