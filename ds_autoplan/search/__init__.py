"""Search: decision-tree strategy space, per-stage DP, BMW and other partitioners,
schedule choice by simulation, baselines (docs/planner.md §1, §3, §4)."""
from .evaluate import Candidate
from .options import SearchOptions
from .planner import Planner, plan_model, search
from .result import SearchResult

__all__ = ["Candidate", "Planner", "SearchOptions", "SearchResult", "plan_model", "search"]
