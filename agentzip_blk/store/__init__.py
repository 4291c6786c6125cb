"""The page store: what the device holds and how (docs/ARCHITECTURE.md walks a page through it).

`PageStore` (pagestore) is the facade; `Tiering` its pool and policy settings.
"""

from .pagestore import PageStore
from .tiering import Tiering

__all__ = ["PageStore", "Tiering"]
