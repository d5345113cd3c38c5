import sys

from ascend_gate.check import main

sys.exit(main())
