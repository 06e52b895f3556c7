"""The host half of the agent protocol's framing: ``corral._guest.protocol``, which the guest
agent runs too (one JSON object per line; the protocol is in ``docs/design/guest-agent.md``).
Shared by the keeper (which talks to the guest and to clients) and the client.
"""

from __future__ import annotations

from ..._guest.protocol import (
    MAX_LINE,
    ProtocolError,
    b64,
    encode,
    read_lines,
    read_one,
    unb64,
)

__all__ = ["MAX_LINE", "ProtocolError", "b64", "encode", "read_lines", "read_one", "unb64"]
