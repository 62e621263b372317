"""`python -m xirang.sim`."""
import signal
import sys

from .cli import main

signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `... | head` ends quietly, as other CLI tools do
sys.exit(main())
