"""The executor contract both runtime adapters implement.

* Vocabulary: the action kinds of :class:`ds_autoplan.schedule.Kind` with one meaning
  (schedule/ir.py; R: :mod:`ds_autoplan.schedule.passes`): F, B (input gradient; weight
  work deferred to W), W, BW, R, and SEND_F/RECV_F/SEND_B/RECV_B, where a RECV only posts the
  receive and the consuming compute waits for the data, a SEND is started and completed at
  the end of the step (the simulator's non-blocking model, schedule/simulator.py).
* :func:`accept`: the same checks of every list an adapter receives, lowered or not, and
  the simulator's proof that it finishes (a list that would hang is refused).
* :func:`check_world`: the plan's tp x pp x dp processes, in both runtimes.
* :func:`waits_for`: the pipeline rank an action depends on, what each adapter tells its
  step watchdog (``runtime.watchdog.StepWatchdog``) as it executes the list.
* :class:`StepState`: the per-step state (schedule, shapes, loss weights) an adapter takes
  with ``set_step`` before the step it applies to.
* :data:`RULES`: the per-kind table both adapters read (part of a forward-only pass, adds
  parameter gradients, which neighbour's data it consumes).
* :func:`dispatch_table`: each adapter executes a list through a table kind -> its
  framework's call that must cover every kind (and every kind must have its rule).
* :class:`Slots`: the per-(stage, micro-batch) state of a step (:class:`Slot`), what an
  action leaves for a later one; at the step's end it must be empty.
"""
from .contract import (KINDS, RULES, Rule, StepState, accept, check_world, deadlock_free,
                       dispatch_table, posting_order, recomputed, waits_for)
from .state import Slot, Slots

__all__ = ["KINDS", "RULES", "Rule", "Slot", "Slots", "StepState", "accept", "check_world",
           "deadlock_free", "dispatch_table", "posting_order", "recomputed", "waits_for"]
