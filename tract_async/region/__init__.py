"""The shared substrate: layout, mapping, node table, root directory (allocator and index live
beside them). No asyncio in this package: the engine and transports use its public functions."""
from .layout import FORMAT_VERSION, LINE_BYTES, layout_signature
from .nodes import NodeHandle, NodeInfo, NodeTable
from .region import BackingInfo, Region, Section, SectionSpec, default_path, remove
from .rootdir import RootDirectory, RootEntry

__all__ = ["FORMAT_VERSION", "LINE_BYTES", "BackingInfo", "NodeHandle", "NodeInfo", "NodeTable",
           "Region", "RootDirectory", "RootEntry", "Section", "SectionSpec", "default_path",
           "layout_signature", "remove"]
