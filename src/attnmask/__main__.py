import sys

from attnmask.cli import main

sys.exit(main())
