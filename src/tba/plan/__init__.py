"""The run plan: every decision a run takes from its config and the machine, resolved once at start
(:mod:`tba.plan.core`), by the rules for each setting left at ``auto`` (:mod:`tba.plan.auto`) and the
placement of each process on the machine's cores and GPUs (:mod:`tba.plan.placement`)."""

from tba.hardware import Hardware
from tba.plan.core import (
    PLAN_FILE,
    Plan,
    builtin_setting,
    make_plan,
    plan_run,
)
from tba.plan.placement import actor_gpu_shares, driver_holds_gpu

__all__ = [
    "PLAN_FILE",
    "Hardware",
    "Plan",
    "actor_gpu_shares",
    "builtin_setting",
    "driver_holds_gpu",
    "make_plan",
    "plan_run",
]
