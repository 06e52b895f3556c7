"""The HTTP service: ``corral serve``."""
