"""The gVisor isolation tier."""

from .backend import GvisorBackend

__all__ = ["GvisorBackend"]
