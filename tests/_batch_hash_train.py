"""`effijax train` with every training batch's SHA-256 appended to $EFFIJAX_TEST_BATCH_LOG.

Runs the real command line in this process; the only change is a wrapper around the batch
builder of the recipe (``effijax.recipe._job.batch_at``) that logs ``step sha256`` lines as the
batches are built, so a test can compare the batches a killed and resumed run read with those of
an uninterrupted run.
"""

import hashlib
import os
import sys

import numpy as np

from effijax.cli import main
from effijax.recipe import _job

_real = _job.batch_at


def _logged(tokens, *, step, **kwargs):
    batch = _real(tokens, step=step, **kwargs)
    digest = hashlib.sha256()
    for name in sorted(batch):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(batch[name]).tobytes())
    with open(os.environ["EFFIJAX_TEST_BATCH_LOG"], "a") as f:
        f.write(f"{step} {digest.hexdigest()}\n")
    return batch


_job.batch_at = _logged

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
