"""Cost model: memory and time of every layer under every intra-stage strategy
(docs/planner.md §2), collectives (§2.3) and the re-layout cost (§2.5)."""
from .collectives import Network
from .model import CostModel, LayerTables, Strategy

__all__ = ["CostModel", "LayerTables", "Network", "Strategy"]
