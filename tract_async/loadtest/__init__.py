"""The serving load harness (``tract bench serve``, ``bench/serve_load.py``), apart from the
workers it measures (``tract_async.serving``): it starts a rack of workers per system, drives
them with a workload, and reports.

* ``runner``: the command line and the run (systems in turn, phases, budget, parts, merge);
* ``workloads``: the request streams (chat, rag, agentic, unique), seeded token ids;
* ``generator``: open-loop arrivals and closed-loop clients, one record per request;
* ``stats``: a phase's metrics from its records; ``report``: results.json and summary.md;
* ``plots``: the figures; ``merge``: one report from runs made in parts.
"""
