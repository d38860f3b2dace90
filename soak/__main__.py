import sys

from soak.main import main

sys.exit(main())
