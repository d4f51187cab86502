"""`tract region init|inspect|rm` as a newcomer types them (through main(), and once as a process)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tract_async.cli import main, parse_size


def test_parse_size() -> None:
    assert parse_size("64M") == 64 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("4096") == 4096


def test_init_inspect_rm(region_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["region", "init", region_path, "--size", "16M", "--max-nodes", "4"]) == 0
    assert "created" in capsys.readouterr().out
    from tract_async.region import Region
    with Region.attach(region_path) as r:
        h = r.nodes.join(2)
        r.nodes.heartbeat(h)
        assert main(["region", "inspect", region_path]) == 0
        out = capsys.readouterr().out
        from tract_async.region.layout import FORMAT_VERSION
        assert f"format v{FORMAT_VERSION}" in out and "max_nodes 4" in out
        assert "node table" in out and "root directory" in out
        row = [line for line in out.splitlines() if line.strip().startswith("2 ")]
        assert row and "live" in row[0] and "yes" in row[0], out
        assert main(["region", "rm", region_path]) == 2       # refuses: node 2 is live
        assert "live" in capsys.readouterr().err
        r.nodes.leave(h)
    assert main(["region", "rm", region_path]) == 0
    assert not os.path.exists(region_path)


def test_errors_are_one_line(region_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["region", "inspect", region_path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tract: RegionNotFound:") and err.count("\n") == 1


def test_console_script_runs(region_path: str) -> None:
    res = subprocess.run([sys.executable, "-m", "tract_async.cli", "region", "init", region_path,
                          "--size", "8M"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    res = subprocess.run([sys.executable, "-m", "tract_async.cli", "region", "inspect", region_path],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "uuid" in res.stdout


def test_a_stray_option_gets_the_subcommands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's parse_args reports it with the top-level usage, which shows no demo option."""
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tract demo ") and "--modes" in err
    assert "tract demo: error: unrecognized arguments: --bogus" in err
    with pytest.raises(SystemExit):
        main(["region", "init", "--bogus"])
    assert "usage: tract region init " in capsys.readouterr().err


def test_size_help_gives_units_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["region", "init", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "K, M, G or T (powers of 1024" in out and "default 256M" in out


def test_help_imports_neither_torch_nor_numba() -> None:
    """``tract --help`` must not pay for torch (about a second on the dev VM) or Numba: the
    package exports resolve lazily and the subcommands import what they need when they run."""
    code = ("import sys\nfrom tract_async.cli import build_parser\nbuild_parser().format_help()\n"
            "print(sorted(m for m in ('torch', 'numba', 'numpy', 'aiohttp', 'transformers') "
            "if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_cli_and_demo_do_not_import_each_other() -> None:
    import ast
    import tract_async.demo as demo
    tree = ast.parse(open(demo.__file__).read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "cli" not in imported and "tract_async.cli" not in imported


def test_rm_of_a_file_that_is_no_region_says_how_to_remove_it(region_path: str,
                                                              capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    with open(region_path, "wb") as f:
        f.write(b"not a region " * 1000)
    assert main(["region", "rm", region_path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tract: RegionCorrupt:") and err.count("\n") == 1
    assert f"`tract region rm --force {region_path}` removes it anyway" in err
    assert os.path.exists(region_path)
    assert main(["region", "rm", "--force", region_path]) == 0
    assert not os.path.exists(region_path)


def test_init_refuses_a_size_without_room_for_one_chunk(region_path: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from tract_async.engine_layout import min_region_bytes
    least = min_region_bytes(max_nodes=8)
    assert main(["region", "init", region_path, "--size", "1M"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tract: RegionTooSmall:") and f"region_bytes={least} " in err
    assert not os.path.exists(region_path)
