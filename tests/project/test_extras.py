"""The core install runs without the ``serve`` extra, and the serving paths name the extra."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tract_async import errors as E
from tract_async.extras import check_installed, require

_BLOCK = ("import sys\n"
          "for name in ('transformers', 'prometheus_client', 'matplotlib', 'pynvml'):\n"
          "    sys.modules[name] = None   # an import of it now fails as if not installed\n")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK + code], capture_output=True, text=True,
                          timeout=300)


def test_core_modules_import_without_the_extra() -> None:
    """Every module outside tract_async.serving imports with the serve extra's packages gone.

    Except the vLLM connector class's module, which is the ``vllm`` extra (vLLM itself needs
    transformers): its package and the connector's other modules are walked like the rest, and
    tests/integrations/test_vllm_parts.py checks that a missing vLLM names its extra."""
    res = _run("import importlib, pkgutil\nimport tract_async, tract_kernels\n"
               "for pkg in (tract_async, tract_kernels):\n"
               "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
               "        if not m.name.startswith('tract_async.serving') and \\\n"
               "                m.name != 'tract_async.integrations.vllm.connector':\n"
               "            importlib.import_module(m.name)\n"
               "from tract_async.cuda.telemetry import _load_nvml\n"
               "print(_load_nvml()[1])\n")
    assert res.returncode == 0, res.stderr
    assert "tract-async[serve]" in res.stdout


def test_serving_and_demo_name_the_extra() -> None:
    res = _run("from tract_async.cli import main\n"
               "assert main(['demo', '--modes', 'http']) == 2\n"
               "import tract_async.serving.tokenizer, tract_async.serving.protocol   # light parts\n"
               "from tract_async.errors import MissingExtra\n"
               "for mod in ('model', 'streaming', 'kv_cache', 'metrics'):\n"
               "    try:\n"
               "        __import__('tract_async.serving.' + mod)\n"
               "    except MissingExtra as e:\n"
               "        print(mod, e)\n")
    assert res.returncode == 0, res.stderr
    err = res.stderr.strip().splitlines()
    assert err[-1].startswith("tract: MissingExtra: tract demo needs transformers, "
                              "prometheus-client, matplotlib"), res.stderr
    assert "pip install 'tract-async[serve]'" in err[-1]
    lines = res.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["model", "streaming", "kv_cache", "metrics"]
    assert all("the 'serve' extra" in line for line in lines)


def test_require_and_check_installed() -> None:
    assert require("json", purpose="x").__name__ == "json"
    with pytest.raises(E.MissingExtra, match="the serving thing needs tract-no-such-mod"):
        require("tract-no-such-mod", purpose="the serving thing")
    with pytest.raises(ImportError):   # MissingExtra is an ImportError: old handlers still work
        check_installed(["json", "tract_no_such_a", "tract_no_such_b"], purpose="p")
    with pytest.raises(E.MissingExtra, match="tract_no_such_a, tract_no_such_b"):
        check_installed(["json", "tract_no_such_a", "tract_no_such_b"], purpose="p")
