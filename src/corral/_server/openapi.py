"""What ``/openapi.json`` says beyond the routes: how to authenticate (so ``/docs`` has an
Authorize button) and the groups operations are listed in."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

__all__ = ["TAGS", "describe"]

#: Tag -> description, in the order ``/docs`` lists them; each router is included under one.
TAGS: dict[str, str] = {
    "sandboxes": "Create, list, inspect and destroy sandboxes; their lifetime, network policy, "
                 "pause and resume.",
    "snapshots": "Seal a sandbox's workspace (and, on some tiers, its memory) as a snapshot; "
                 "fork sandboxes from it; restore it.",
    "commands": "Run a command to completion or as an NDJSON stream; kill it.",
    "processes": "Background processes and terminals: start, list, read output, write input, "
                 "kill.",
    "code": "The code interpreter: cells in Python, JavaScript, TypeScript, R or bash kernels, "
            "and the contexts whose state persists between cells.",
    "files": "The workspace's files: read, write, list, stat, remove, rename, mkdir; whole "
             "trees as tar.",
    "ports": "Expose a port a sandbox listens on through the service's proxy, with tokens and "
             "signed links.",
    "volumes": "Named volumes that outlive sandboxes and mount into them.",
    "audit": "Each sandbox's audit trail, and the service's Prometheus metrics.",
    "service": "Whether the service is up.",
}

_SCHEME = "apiKey"


def describe(app: FastAPI) -> None:
    """Add the API key scheme (``Authorization: Bearer ck_...``) to ``app``'s document, as the
    default for every operation but those that need none."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schema.setdefault("components", {})["securitySchemes"] = {_SCHEME: {
            "type": "http", "scheme": "bearer", "bearerFormat": "ck_...",
            "description": "An API key from `corral keys create TENANT`. On loopback with no "
                           "key ever created, none is needed. Signed in to the dashboard in "
                           "this browser, /docs uses that session instead."}}
        schema["security"] = [{_SCHEME: []}]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
