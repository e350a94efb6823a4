"""`python -m distserver ...` is the `distserver` command."""

import sys

from distserver.cli import main

sys.exit(main())
