"""Communication scheduling: plans (buckets, lanes, chunks), policies and the progress engine."""

from scaleout.scheduler.config import POLICIES, SchedulerConfig
from scaleout.scheduler.engine import Job, ProgressEngine
from scaleout.scheduler.plan import (BucketPlan, PlanItem, build_plan, chunk_needs, chunks_ready,
                                     plan_and_policy)
from scaleout.scheduler.policy import FifoPolicy, LaneState, Policy, PriorityPolicy, make_policy

__all__ = [
    "SchedulerConfig", "POLICIES", "PlanItem", "BucketPlan", "build_plan", "chunk_needs",
    "chunks_ready", "plan_and_policy", "Policy",
    "FifoPolicy", "PriorityPolicy", "LaneState", "make_policy", "Job", "ProgressEngine",
]
