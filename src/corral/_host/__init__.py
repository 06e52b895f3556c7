"""Preparing a host for Corral: its Debian packages and its service unit (``corral setup``)."""
