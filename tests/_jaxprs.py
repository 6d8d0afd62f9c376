"""Walking a traced program: the equations of a jaxpr and of every sub-jaxpr (loops, scans,
custom VJPs, remat) that call a given primitive."""

import jax.extend.core


def eqns(jaxpr, name: str) -> list:
    """Every equation of ``jaxpr`` (a ``jax.core.Jaxpr``) and of its sub-jaxprs whose primitive
    is ``name`` (``"dot_general"``, ``"random_bits"``, ...), in program order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += eqns(sub, name)
    return found
