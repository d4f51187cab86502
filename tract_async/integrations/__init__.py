"""Integrations of tract_async with serving frameworks, each behind its own optional extra.

``tract_async.integrations.vllm``: a KV connector of vLLM's v1 connector API (``pip install
'tract-async[vllm]'``). Importing this package imports no framework.
"""
