"""``python -m tba``: the ``tba`` command (:func:`tba.cli.main`)."""

import sys

from tba.cli import main

sys.exit(main())
