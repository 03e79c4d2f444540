"""`python -m tokenmill.kernels [--isa VARIANT]`: build the CPU kernels now (see build.main)."""
import sys

from .build import main

sys.exit(main())
