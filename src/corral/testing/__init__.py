"""Test helpers: run Corral's control plane and SDK without root (``corral.testing.backend``).

Nothing here isolates anything; never serve untrusted code with it."""
