"""The service one ``corral serve`` process runs, assembled: the native API with the dashboard
mounted in it (``app``), the E2B dialect's listener beside it, and running both (``run``).

The one place that knows every surface: ``_server``, ``_e2b`` and ``_ui`` never import each
other, so what joins them lives here, above them (docs/architecture.md)."""
