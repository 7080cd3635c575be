import sys

from forged.cli import main

sys.exit(main())
