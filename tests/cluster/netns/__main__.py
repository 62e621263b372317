"""``sudo python3 tests/cluster/netns ARGS`` (or ``python3 -m netns`` from tests/cluster)."""
import os
import sys

if not __package__:  # run as a directory: import the package by its name, not its files as modules
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from netns.cli import main
else:
    from .cli import main

sys.exit(main())
