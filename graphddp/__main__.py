import sys

from graphddp.frontend.cli import main

sys.exit(main())
