"""``--dist loadgroup`` that groups: the ``@group`` suffix in the node id pytest 9 reads.

pytest-xdist 3.8 marks a grouped item by writing ``f"{nodeid}@{group}"`` into ``item._nodeid``,
a field pytest 9.2 no longer reads (its node id is ``str(item._id)``, a structured NodeId): every
test was then its own scope, and the racks of serving processes (``xdist_group("racks")``) ran
on several workers at once, which their grouping exists to prevent (two at once on two cores
starved a decode service past its SIGTERM grace). ``apply`` writes the suffix where pytest 9
reads it; the scheduler splits the scope off at the ``@``, and reports show it
(``test_x@racks``), as they do where xdist's own suffix works.

``tests/conftest.py`` calls ``apply`` from its collection hook; as a plugin (``-p
tests.support.xdist_groups``) the module does the same on its own (its test,
``tests/project/test_xdist_groups.py``, runs a suite outside this tree).
"""
from __future__ import annotations

import pytest


def apply(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each item marked ``xdist_group`` its group suffix (once; only with loadgroup)."""
    if not getattr(config.option, "loadgroup", False) and \
            getattr(config.option, "dist", "no") != "loadgroup":
        return
    from _pytest.nodeid import coerce_node_id
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


@pytest.hookimpl(trylast=True)   # after pytest-xdist's own hook
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    apply(config, items)
