"""``benchmarks/context.py``: its bisection, the longest sequence found at both ends of the
search, and the ring against the all-gather variant at a small size."""

import pytest
from _benchmarks import script_fixture

bench = script_fixture("context", "bench")


def test_the_bisection_finds_the_last_length_that_fits(bench):
    asked = []

    def fits(s):
        asked.append(s)
        return s <= 5000

    assert bench.longest(fits, 512, 8192) == 4608
    assert len(asked) <= 6  # 8192, then halving over 16 multiples
    assert bench.longest(lambda s: True, 512, 100) is None  # no multiple of 512 up to 100


def test_the_predicted_length_is_where_effijax_memory_passes_the_budget(bench):
    """The formula's side (no compiling): the length found fits, one step more does not, and
    the context axis fits a longer one."""
    budget, step, cap = 12 * 10**6, 256, 4096

    def longest(context):
        return bench.longest(
            lambda s: bench.memory("tiny", s, context, "bf16")["total_bytes"] <= budget,
            step, cap)

    one, split = longest(1), longest(8)
    assert bench.memory("tiny", one, 1, "bf16")["total_bytes"] <= budget
    assert bench.memory("tiny", one + step, 1, "bf16")["total_bytes"] > budget
    assert split > one


@pytest.mark.slow  # four attention programs compiled and run on 8 devices: ~3 s on 2 cores
def test_the_all_gather_variant_holds_more_than_the_ring(bench):
    import jax.numpy as jnp

    rows = bench.variant_rows([256], 4, 2, 16, jnp.bfloat16, rounds=1, steps=1)
    assert [(r[0], r[1]) for r in rows] == [(256, "ring"), (256, "all_gather")]
    assert rows[0][3] == "1.00x" and float(rows[0][2]) > 0 and float(rows[1][2]) > 0

    def kib(text):
        value, unit = text.split()
        return float(value) * {"B": 1 / 1000, "KB": 1, "MB": 1000}[unit]

    # Every device's K/V gathered against one travelling shard: more temporaries, not fewer.
    assert kib(rows[1][4]) > kib(rows[0][4])
