"""The web dashboard served at ``/ui`` (and ``/docs``), from assets in the package."""
