"""`effijax train` with every training batch's SHA-256 appended to $EFFIJAX_TEST_BATCH_LOG.

Runs the real command line in this process; the only change is a wrapper around the batches the
recipe's loop takes (the ``batch_fn`` that ``effijax.recipe._loop`` hands to
:func:`effijax.run.train_loop`), which logs ``step sha256`` lines as the loop reads each step's
batch, so a test can compare the batches a killed and resumed run read with those of an
uninterrupted run. The loop's batches are built ahead on a thread (``effijax.data.Prefetcher``);
one built for a step that never runs is never read, so it is not logged.
"""

import hashlib
import os
import sys

import numpy as np

from effijax.cli import main
from effijax.recipe import _loop

_real_loop = _loop.train_loop


def _log(step: int, batch: dict) -> None:
    digest = hashlib.sha256()
    for name in sorted(batch):
        if name == "base":  # a LoRA run's frozen base rides in every batch: not data
            continue
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(np.asarray(batch[name])).tobytes())
    with open(os.environ["EFFIJAX_TEST_BATCH_LOG"], "a") as f:
        f.write(f"{step} {digest.hexdigest()}\n")


def _logged_loop(step_fn, state, batch_fn, **kwargs):
    def batch(step):
        out = batch_fn(step)
        _log(step, out)
        return out

    return _real_loop(step_fn, state, batch, **kwargs)


_loop.train_loop = _logged_loop

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
