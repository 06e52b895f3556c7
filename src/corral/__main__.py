"""``python -m corral`` is the CLI."""

from ._cli.main import main

main()
