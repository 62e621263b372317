"""`python -m xirang.report`."""
import sys

from .cli import main

sys.exit(main())
