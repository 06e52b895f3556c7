"""Images as templates: references and the registry allowlist (``reference``), safe unpacking
(``unpack``), the config a sandbox honours (``config``), pulls (``pull``).

A pulled image becomes an ordinary template build (``corral._templates.catalog``), so every
tier runs it like a template built from Debian packages; its config (environment, working
directory, entrypoint and command) travels in the build's metadata. Nothing is imported here:
the tiers read ``config`` without loading the pull machinery (which imports them back).
"""
