"""Search: decision-tree strategy space, per-stage DP, BMW and other partitioners,
schedule choice by simulation, baselines (docs/planner.md §1, §3, §4)."""
from .planner import Candidate, Planner, SearchResult, plan_model, search

__all__ = ["Candidate", "Planner", "SearchResult", "plan_model", "search"]
