"""`effijax train` whose data takes $EFFIJAX_TEST_BATCH_DELAY_S seconds per training batch
until the process gets SIGTERM or SIGINT.

Runs the real command line in this process; the only changes are a wait before the recipe's
batch builder (each objective's ``batch``: :func:`effijax.data.batch_at` for ``sft``, the
preference objectives' pairs; GRPO's rollout) builds each batch, as a slow data pipeline
would, and a note in the run's stop handler (``effijax.run.StopFlag._handle``, which it then
calls) that ends the waits. A test that signals a run and needs it to be still training some
seconds later (Open MPI's mpirun forwards SIGTERM to its ranks only after a grace period) holds
a short run open this way instead of running hundreds of steps; once the signal arrives the run
goes at full speed to the step boundary where the processes agree to stop (polled every few
steps) and saves. A test that kills a run (SIGKILL) holds it training the same way. The
batches, and so the numbers, are the unwrapped builder's.
"""

import os
import sys
import time

from effijax import run
from effijax.cli import main
from effijax.recipe import _objectives

_real_handle = run.StopFlag._handle
_DELAY_S = float(os.environ.get("EFFIJAX_TEST_BATCH_DELAY_S", "0"))
_signalled = []  # appended to by the handler: no lock (it runs between bytecodes)


def _wait() -> None:
    deadline = time.monotonic() + _DELAY_S
    while not _signalled and time.monotonic() < deadline:
        time.sleep(0.02)


def _slowed(batch):
    def slow(tokens, **kwargs):
        _wait()
        return batch(tokens, **kwargs)

    return slow


def _slowed_rollouts(rollout):
    """GRPO's ``rollout`` factory whose ``draw`` waits before it samples each batch (and keeps
    the draw's ``carried``/``resume``, its rollout saved inside a group of steps)."""
    def make(*args, **kwargs):
        draw = rollout(*args, **kwargs)
        slow = _slowed(draw)
        for name in ("carried", "resume"):
            if hasattr(draw, name):
                setattr(slow, name, getattr(draw, name))
        return slow

    return make


def _handle(self, signum, frame):
    _signalled.append(signum)
    _real_handle(self, signum, frame)


for _name, _objective in list(_objectives.OBJECTIVES.items()):
    if _objective.batch is not None:
        _objectives.OBJECTIVES[_name] = _objective._replace(batch=_slowed(_objective.batch))
    if _objective.rollout is not None:  # GRPO samples its batches from the policy
        _objectives.OBJECTIVES[_name] = _objectives.OBJECTIVES[_name]._replace(
            rollout=_slowed_rollouts(_objective.rollout))
run.StopFlag._handle = _handle

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
