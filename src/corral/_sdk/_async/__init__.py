"""The hand-written async SDK; ``_sync/`` is generated from it by ``scripts/unasync``."""
