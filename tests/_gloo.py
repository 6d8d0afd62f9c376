"""``not_gloo(lines)``: a process's output lines without gloo's connection messages.

gloo (the CPU collectives of a multi-process run) prints "[Gloo] Rank 5 is connected to 7 peer
ranks. Expected number of connected peer ranks is : 7" from several C++ threads at once, so
its lines interleave: a blank line, or a fragment such as "5 is connected to 7 peer ranks. ..."
without the "[Gloo]" prefix (seen in CI and under load). Those are not effijax's to silence;
everything else a quiet process prints is.

    >>> not_gloo(["[Gloo] Rank [Gloo] Rank 1 is connected to 7 peer ranks. Expected number "
    ...           "of connected peer ranks is : 7", "", " is connected to 7 peer ranks. "
    ...           "Expected number of connected peer ranks is : 7", "effijax: hello"])
    ['effijax: hello']
"""

import re

_DEBRIS = re.compile(r"\[Gloo\]|Rank|Expected number of connected peer ranks is|"
                     r"is connected to|peer ranks|[\d\s.:]")


def not_gloo(lines):
    """The lines left once gloo's messages (and fragments of them) are removed."""
    return [x for x in lines if _DEBRIS.sub("", x)]
