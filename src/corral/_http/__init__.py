"""The HTTP kit every surface shares (the native API, the E2B dialect, the dashboard, the cluster
gateway): the pure-ASGI guards (``guard``), key and session checks (``keys``), body limits
(``bodies``), the relays to a sandbox's port or a node (``relay``, ``portproxy``, ``preview``),
the 5xx log (``errorlog``), every dialect's error answers (``errors``) and the FastAPI
dependencies the routes take (``deps``).

It knows the control plane and nothing above it: a surface imports this kit, never a sibling
surface (docs/architecture.md)."""
