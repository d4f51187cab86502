"""``./kernels`` (our kernels' source folder) must not shadow Hugging Face's ``kernels``.

transformers >= 5.25 requires Hugging Face's ``kernels`` and imports it; with the repository root
on ``sys.path`` (pytest's ``pythonpath``, spawned workers) it got our folder and failed
(``tract_async/_kernels_name.py``). A stand-in ``kernels`` after the root on ``sys.path`` plays
the installed one.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, first: str) -> str:
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("CUDAProperties = 'the other kernels'\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}]
        sys.path.append({str(tmp_path / 'site')!r})
        {first}
        import kernels
        print(('ours: ' if kernels.__file__.startswith({str(ROOT / 'kernels') + os.sep!r})
               else 'other: ')
              + kernels.__file__)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_after_tract_async_kernels_is_the_other_package(tmp_path: Path) -> None:
    # the stand-in, or a real Hugging Face kernels installed in site-packages: never ours
    assert _run(tmp_path, "import tract_async").startswith("other: ")


def test_without_it_the_root_folder_shadows_it(tmp_path: Path) -> None:
    """The negative control: the failure the finder prevents."""
    assert _run(tmp_path, "pass").startswith("ours: ")
