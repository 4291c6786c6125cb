"""agentzip-blk: a compressed, deduplicating userspace swap device for agent sandboxes."""

__version__ = "0.1.0"
