"""The guest agent's entry point: ``python3 -I -S /corral/agent.pyz`` (init's command line;
the zipapp's own ``__main__`` runs this module's ``main``)."""

from __future__ import annotations

import os
import sys

from .agent import Agent
from .channel import Channel
from .config import Config
from .dispatch import serve


def main() -> None:
    config = Config.from_env(dict(os.environ))
    agent = Agent(config, Channel(config.channel))
    agent.setup()
    try:
        serve(agent)
    finally:
        agent.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
