"""Audit floods: what a sandbox makes the host write about it is bounded, and the bound is
recorded, never a silently cut trail nor a full disk."""

from __future__ import annotations

from ..model import Case

CASES: list[Case] = []
