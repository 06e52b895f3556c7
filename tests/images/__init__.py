"""Test infrastructure for OCI images: hand-built image layouts (normal and hostile) and a real
local registry to push them to."""
