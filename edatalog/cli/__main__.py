"""python -m edatalog.cli"""

import sys

from edatalog.cli import main

sys.exit(main())
