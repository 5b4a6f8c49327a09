"""report.md and PNG plots for a search result."""
from .writer import report_files

__all__ = ["report_files"]
