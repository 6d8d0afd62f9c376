"""``assert_close_except_noise``: sharded runs against the single-device run, leaf by leaf.

The GPT's key bias has an exact gradient of 0: ``q·b_k`` adds the same number to every score
of a query and softmax ignores it. What it holds is rounding noise (~1e-6 after a few steps,
which Adam's normalisation makes as large as it is), and noise differs when the reduction order
does (another mesh, another strategy): it is checked to stay noise-sized instead of equal.
"""

import jax
import numpy as np

from effijax.paths import named_leaves

NOISE = "blocks/attn/k/bias"


def assert_close_except_noise(actual, desired, *, rtol, atol, noise=1e-4):
    """Every leaf of ``actual`` within ``rtol``/``atol`` of ``desired``'s, the noise leaf below
    ``noise`` in both (1e-4: f32 noise after a few Adam steps; fp16 compute's noise gradients
    are large enough for Adam to move the leaf by up to the learning rate per step)."""
    for (path, a), (_, d) in zip(named_leaves(jax.device_get(actual)),
                                 named_leaves(jax.device_get(desired)), strict=True):
        if path.endswith(NOISE):
            assert np.max(np.abs(a)) < noise and np.max(np.abs(d)) < noise, path
        else:
            np.testing.assert_allclose(a, d, rtol=rtol, atol=atol, err_msg=path)
