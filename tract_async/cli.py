"""The ``tract`` command: ``tract region init|inspect|rm|fsck``, ``tract warmup``, ``tract demo``.

Each subcommand is a small function over the public API; ``main`` only parses arguments and maps
``TractError`` to a one-line message and exit status 2 (1 is left for "fsck found problems").
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from .errors import TractError
from .units import SIZE_HELP, fmt_bytes, parse_size


def cmd_region_init(args: argparse.Namespace) -> int:
    from .errors import RegionExists
    from .region import Region, default_path
    path = args.path or default_path(args.name)
    from .engine_layout import check_create_size, initialize, region_sections
    # a region without room for one chunk is created fine and every engine then refuses it
    check_create_size(path=path, region_bytes=args.size, max_nodes=args.max_nodes)
    # the same sections, formatted the same way, as Engine.open(create=True) makes (the index
    # header included: an unformatted index is a region no engine can attach)
    sections = region_sections(size_bytes=args.size, max_nodes=args.max_nodes)
    try:
        r = Region.create(path, args.size, max_nodes=args.max_nodes, sections=sections,
                          overwrite=args.force, backend=args.backend, initialize=initialize)
    except RegionExists:   # the library's hint names its keyword; this command's is --force
        raise RegionExists(f"{path}: a region (or another file) is already there: "
                           f"`tract region init --force {path}` replaces it, "
                           f"`tract region rm {path}` removes it") from None
    with r:
        print(f"created {path}: {fmt_bytes(r.size_bytes)}, max_nodes={r.max_nodes}, uuid {r.uuid}")
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
        lines.append(f"  size {fmt_bytes(h['region_bytes'])}  uuid {r.uuid}  created "
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
        lines.append(f"  {'header':<24} {0:>14} {fmt_bytes(L.HEADER_RESERVED_BYTES):>12}")
        lines.append(f"  {'node table':<24} {h['node_table_offset']:>14} "
                     f"{fmt_bytes(h['node_table_bytes']):>12}")
        lines.append(f"  {'root directory':<24} {h['rootdir_offset']:>14} "
                     f"{fmt_bytes(h['rootdir_bytes']):>12}")
        for e in r.root.entries():
            lines.append(f"  {e.name:<24} {e.offset_bytes:>14} {fmt_bytes(e.nbytes):>12}")
        from .region.namespaces import NamespaceTable
        lines.append("namespaces (the KV layout each one's blocks have):")
        for rec in NamespaceTable.of(r).records():
            lines.append(f"  {rec.tag:<3} {rec.layout.describe()}; recorded by node "
                         f"{rec.recorded_by}")
        from .tools.fsck import usage_lines  # lock, allocator and index state
        lines.extend(usage_lines(r))
    return "\n".join(lines)


def cmd_region_inspect(args: argparse.Namespace) -> int:
    print(inspect_text(args.path, backend=args.backend))
    return 0


def cmd_region_rm(args: argparse.Namespace) -> int:
    from .errors import RegionError, RegionNotFound, RegionPermissionError
    from .region import Region, remove
    if not args.force:
        try:
            r = Region.attach(args.path, readonly=True)
        except (RegionNotFound, RegionPermissionError):
            raise
        except RegionError as e:   # not a region this build reads: say how to remove it anyway
            raise type(e)(f"{e}; not removed: `tract region rm --force {args.path}` removes "
                          f"it anyway") from None
        with r:
            live = r.nodes.live_ids()
        if live:
            print(f"refusing to remove {args.path}: nodes {live} are live (use --force)",
                  file=sys.stderr)
            return 2
    remove(args.path)
    print(f"removed {args.path}")
    return 0


def cmd_region_fsck(args: argparse.Namespace) -> int:
    from .tools.fsck import run_fsck
    report = run_fsck(args.path, repair=args.repair)
    print(report.text())
    return 0 if report.clean else 1


def cmd_warmup(args: argparse.Namespace) -> int:
    from .tools.warmup import warm_up
    warm_up(backends=tuple(args.backend or ("hw", "sim")), verbose=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole ``tract`` command line. Each leaf subcommand records its own parser
    (``_parser``), so that ``main`` reports a stray argument with that subcommand's usage."""
    p = argparse.ArgumentParser(prog="tract", description="tract_async: KV-cache transfer and "
                                "prefix cache over shared (CXL) memory")
    sub = p.add_subparsers(dest="command", required=True)
    reg = sub.add_parser("region", help="create, inspect, check or remove a region")
    rsub = reg.add_subparsers(dest="region_command", required=True)

    init = rsub.add_parser("init", help="create (format) a region")
    init.add_argument("path", nargs="?", help="region path (default /dev/shm/tract-<name>)")
    init.add_argument("--name", default="demo", help="name for the default path (default demo)")
    init.add_argument("--size", type=parse_size, default=parse_size("256M"),
                      help=f"region size: {SIZE_HELP}; default 256M")
    init.add_argument("--max-nodes", type=int, default=8, help="node table size (default 8)")
    init.add_argument("--force", action="store_true", help="overwrite an existing region")
    init.add_argument("--backend", choices=["hw", "sim"], default=None)
    init.set_defaults(func=cmd_region_init, _parser=init)

    ins = rsub.add_parser("inspect", help="print header, nodes and sections")
    ins.add_argument("path")
    ins.add_argument("--backend", choices=["hw", "sim"], default=None)
    ins.set_defaults(func=cmd_region_inspect, _parser=ins)

    rm = rsub.add_parser("rm", help="remove a region")
    rm.add_argument("path")
    rm.add_argument("--force", action="store_true", help="remove even with live nodes")
    rm.set_defaults(func=cmd_region_rm, _parser=rm)

    fsck = rsub.add_parser("fsck", help="check every invariant; --repair fixes what recovery would")
    fsck.add_argument("path")
    fsck.add_argument("--repair", action="store_true")
    fsck.set_defaults(func=cmd_region_fsck, _parser=fsck)

    warm = sub.add_parser("warmup", help="compile every Numba kernel once into Numba's cache "
                          "($NUMBA_CACHE_DIR), so that later processes start warm")
    warm.add_argument("--backend", action="append", choices=["hw", "sim"],
                      help="backend(s) to warm (default both)")
    warm.set_defaults(func=cmd_warmup, _parser=warm)

    from .demo import add_demo_parser  # light: the serving stack is imported when it runs
    add_demo_parser(sub)

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
    from .loadtest.runner import main as bench_main
    return bench_main(list(args.bench_args))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # parse_args would report a stray option of a subcommand with the top-level usage
    # ("usage: tract [-h] {region,demo} ..."), which does not show the options that exist
    args, extra = parser.parse_known_args(argv)
    leaf = vars(args).pop("_parser", parser)   # the subcommands get only their own options
    if extra:
        leaf.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except TractError as e:
        print(f"tract: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
