"""``corral mcp``: Corral's sandboxes as tools of a Model Context Protocol server.

Built on the official ``mcp`` SDK (``mcp.server.mcpserver.MCPServer``, FastMCP's successor in
mcp 2.x). See ``server.py`` for the per-session sandbox rules, ``tools.py`` for the tools
(each written once) and ``sessions.py`` for the sessions behind them.
"""

from __future__ import annotations

from .server import (
    DEFAULT_CEILING,
    OUTPUT_CAP_BYTES,
    CorralMCP,
    build_server,
    mcp_ceiling,
    serve,
)

__all__ = ["DEFAULT_CEILING", "OUTPUT_CAP_BYTES", "CorralMCP", "build_server", "mcp_ceiling",
           "serve"]
