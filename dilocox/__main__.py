import sys

from dilocox.cli import main

sys.exit(main())
