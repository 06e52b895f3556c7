"""The namespace isolation tier."""

from .backend import NamespaceBackend

__all__ = ["NamespaceBackend"]
