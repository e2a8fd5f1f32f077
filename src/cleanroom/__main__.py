"""``python -m cleanroom`` is the ``cleanroom`` command."""

from cleanroom.cli import main

main()
