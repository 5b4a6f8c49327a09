"""report.md and PNG plots for a search result."""
from .writer import write_report

__all__ = ["write_report"]
