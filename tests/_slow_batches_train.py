"""`effijax train` whose data takes $EFFIJAX_TEST_BATCH_DELAY_S seconds per training batch.

Runs the real command line in this process; the only change is a sleep before the recipe's batch
builder (``effijax.recipe._job.batch_at``) builds each batch, as a slow data pipeline would. A
test that signals a run and needs it to be still training some seconds later (Open MPI's mpirun
forwards SIGTERM to its ranks only after a grace period) holds a short run open this way instead
of running hundreds of steps; the batches, and so the numbers, are the unwrapped builder's.
"""

import os
import sys
import time

from effijax.cli import main
from effijax.recipe import _job

_real = _job.batch_at
_DELAY_S = float(os.environ.get("EFFIJAX_TEST_BATCH_DELAY_S", "0"))


def _slow(tokens, **kwargs):
    time.sleep(_DELAY_S)
    return _real(tokens, **kwargs)


_job.batch_at = _slow

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
