"""The ``tract`` command: ``tract region init|inspect|rm|fsck`` and ``tract demo``.

Each subcommand is a small function over the public API; ``main`` only parses arguments and maps
``TractError`` to a one-line message and exit status 2 (1 is left for "fsck found problems").
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from .errors import TractError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'64M', '1G', '4096', '1.5G' -> bytes. Raises argparse.ArgumentTypeError."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: expected e.g. 4096, 64M, 1G") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return int(value * _UNITS[unit])


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_region_init(args: argparse.Namespace) -> int:
    from .region import Region, default_path
    path = args.path or default_path(args.name)
    sections = []
    try:
        from .engine_layout import region_sections  # provided once the engine exists
        sections = region_sections(size_bytes=args.size, max_nodes=args.max_nodes)
    except ImportError:
        pass
    with Region.create(path, args.size, max_nodes=args.max_nodes, sections=sections,
                       overwrite=args.force, backend=args.backend) as r:
        print(f"created {path}: {_fmt_bytes(r.size_bytes)}, max_nodes={r.max_nodes}, uuid {r.uuid}")
    return 0


def inspect_text(path: str, *, backend: str | None = None) -> str:
    """The human report of ``tract region inspect``."""
    from .region import Region
    from .region import layout as L
    lines: list[str] = []
    with Region.attach(path, readonly=True, backend=backend) as r:
        h = r.header
        lines.append(f"region {path}  ({r.backing.kind})")
        lines.append(f"  magic {h['magic']:#018x}  format v{h['format_version']}  "
                     f"signature {h['layout_signature']:#018x}  line {h['line_bytes']} B")
        lines.append(f"  size {_fmt_bytes(h['region_bytes'])}  uuid {r.uuid}  created "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(h['created_ns'] / 1e9))}")
        lines.append(f"  max_nodes {h['max_nodes']}  root slots {h['root_slots']}")
        lines.append("nodes:")
        lines.append("  id  state  live  epoch  pid      heartbeat age  beats")
        for n in r.nodes.all():
            if n.state == L.NODE_FREE and n.epoch == 0:
                continue
            age = "-" if n.heartbeat_ns == 0 else f"{n.heartbeat_age_s:10.3f} s"
            lines.append(f"  {n.node_id:<3} {n.state_name:<6} {'yes' if n.live else 'no':<5} "
                         f"{n.epoch:<6} {n.pid:<8} {age:>14} {n.heartbeat_seq:>6}")
        lines.append("sections:")
        lines.append(f"  {'header':<24} {0:>14} {_fmt_bytes(L.HEADER_RESERVED_BYTES):>12}")
        lines.append(f"  {'node table':<24} {h['node_table_offset']:>14} "
                     f"{_fmt_bytes(h['node_table_bytes']):>12}")
        lines.append(f"  {'root directory':<24} {h['rootdir_offset']:>14} "
                     f"{_fmt_bytes(h['rootdir_bytes']):>12}")
        for e in r.root.entries():
            lines.append(f"  {e.name:<24} {e.offset_bytes:>14} {_fmt_bytes(e.nbytes):>12}")
        try:
            from .region.usage import usage_lines  # section use, once the allocator exists
            lines.extend(usage_lines(r))
        except ImportError:
            pass
    return "\n".join(lines)


def cmd_region_inspect(args: argparse.Namespace) -> int:
    print(inspect_text(args.path, backend=args.backend))
    return 0


def cmd_region_rm(args: argparse.Namespace) -> int:
    from .region import Region, remove
    if not args.force:
        with Region.attach(args.path, readonly=True) as r:
            live = r.nodes.live_ids()
        if live:
            print(f"refusing to remove {args.path}: nodes {live} are live (use --force)",
                  file=sys.stderr)
            return 2
    remove(args.path)
    print(f"removed {args.path}")
    return 0


def cmd_region_fsck(args: argparse.Namespace) -> int:
    from .region.fsck import run_fsck
    report = run_fsck(args.path, repair=args.repair)
    print(report.text())
    return 0 if report.clean else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tract", description="tract_async: KV-cache transfer and "
                                "prefix cache over shared (CXL) memory")
    sub = p.add_subparsers(dest="command", required=True)
    reg = sub.add_parser("region", help="create, inspect, check or remove a region")
    rsub = reg.add_subparsers(dest="region_command", required=True)

    init = rsub.add_parser("init", help="create (format) a region")
    init.add_argument("path", nargs="?", help="region path (default /dev/shm/tract-<name>)")
    init.add_argument("--name", default="demo", help="name for the default path")
    init.add_argument("--size", type=parse_size, default=parse_size("256M"))
    init.add_argument("--max-nodes", type=int, default=8)
    init.add_argument("--force", action="store_true", help="overwrite an existing region")
    init.add_argument("--backend", choices=["hw", "sim"], default=None)
    init.set_defaults(func=cmd_region_init)

    ins = rsub.add_parser("inspect", help="print header, nodes and sections")
    ins.add_argument("path")
    ins.add_argument("--backend", choices=["hw", "sim"], default=None)
    ins.set_defaults(func=cmd_region_inspect)

    rm = rsub.add_parser("rm", help="remove a region")
    rm.add_argument("path")
    rm.add_argument("--force", action="store_true", help="remove even with live nodes")
    rm.set_defaults(func=cmd_region_rm)

    fsck = rsub.add_parser("fsck", help="check every invariant; --repair fixes what recovery would")
    fsck.add_argument("path")
    fsck.add_argument("--repair", action="store_true")
    fsck.set_defaults(func=cmd_region_fsck)

    try:
        from .demo import add_demo_parser  # the main job, once it exists
        add_demo_parser(sub)
    except ImportError:
        pass

    bench = sub.add_parser("bench", help="benchmarks: `tract bench serve --help`")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    # every argument goes to the benchmark's own parser, imported only when it runs (the
    # unused prefix character keeps argparse from taking its options for ours)
    serve = bsub.add_parser("serve", add_help=False, prefix_chars="\0",
                            help="the paper's evaluation under load against named baselines")
    serve.add_argument("bench_args", nargs="*")
    serve.set_defaults(func=cmd_bench_serve)
    return p


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from .serving.loadbench import main as bench_main
    return bench_main(list(args.bench_args))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TractError as e:
        print(f"tract: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
