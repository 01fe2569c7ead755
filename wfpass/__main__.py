import sys

from .tools.cli import main

# Guarded: ``bench`` starts worker processes with "spawn", which imports
# this module again in each of them.
if __name__ == "__main__":
    sys.exit(main())
