import sys

from graphddp.cli import main

sys.exit(main())
