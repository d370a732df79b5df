"""Chakra execution traces: ``name.<rank>.et`` files in the schema of Chakra's ``et_def.proto``.

The message classes are built from a descriptor written here, field for field as in
``et_def.proto`` (package ``ChakraProtoMsg``: ``GlobalMetadata``, ``Node``, ``AttributeProto``
and its list types, ``IOInfo``; enums ``NodeType`` and ``CollectiveCommType``), with
protobuf's descriptor pool: only the ``protobuf`` package is needed, no ``protoc`` and no
generated code (mlc-chakra, which ships the generated module, pins an analysis stack we do
not need). A file is a stream of varint32-length-prefixed messages: one ``GlobalMetadata``,
then the nodes.

Example:
    >>> schema = load_schema()
    >>> node = schema.Node(id=1, name="fwd", type=schema.NodeType.Value("COMP_NODE"),
    ...                    duration_micros=10)
    >>> schema.Node.FromString(node.SerializeToString()).duration_micros
    10
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["NODE_TYPES", "COMM_TYPES", "ChakraSchema", "load_schema", "read_et", "write_et",
           "check_nodes", "attributes", "make_attr", "et_path"]

NODE_TYPES = (
    "INVALID_NODE",
    "METADATA_NODE",
    "MEM_LOAD_NODE",
    "MEM_STORE_NODE",
    "COMP_NODE",
    "COMM_SEND_NODE",
    "COMM_RECV_NODE",
    "COMM_COLL_NODE",
    "STORAGE_NODE",  # 8-10 since stop 52 (refused as unknown before): et_def.proto's newer
    "BATCH_NODE",  # types, run for their recorded duration on the compute stream (graph.py)
    "CHECKPOINT_NODE",
)
COMM_TYPES = (
    "ALL_REDUCE",
    "REDUCE",
    "ALL_GATHER",
    "GATHER",
    "SCATTER",
    "BROADCAST",
    "ALL_TO_ALL",
    "REDUCE_SCATTER",
    "REDUCE_SCATTER_BLOCK",
    "BARRIER",
)
_BARRIER = COMM_TYPES.index("BARRIER")
_SCALARS = (
    ("double", "TYPE_DOUBLE"),
    ("float", "TYPE_FLOAT"),
    ("int32", "TYPE_INT32"),
    ("int64", "TYPE_INT64"),
    ("uint32", "TYPE_UINT32"),
    ("uint64", "TYPE_UINT64"),
    ("sint32", "TYPE_SINT32"),
    ("sint64", "TYPE_SINT64"),
    ("fixed32", "TYPE_FIXED32"),
    ("fixed64", "TYPE_FIXED64"),
    ("sfixed32", "TYPE_SFIXED32"),
    ("sfixed64", "TYPE_SFIXED64"),
    ("bool", "TYPE_BOOL"),
    ("string", "TYPE_STRING"),
    ("bytes", "TYPE_BYTES"),
)


@dataclass(frozen=True)
class ChakraSchema:
    """The message classes and enums of ``ChakraProtoMsg``."""

    GlobalMetadata: Any
    Node: Any
    AttributeProto: Any
    IOInfo: Any
    NodeType: Any
    CollectiveCommType: Any
    lists: dict


def _file_descriptor() -> Any:
    from google.protobuf import descriptor_pb2 as d

    F = d.FieldDescriptorProto
    fdp = d.FileDescriptorProto(name="et_def.proto", package="ChakraProtoMsg", syntax="proto3")

    def message(name: str, fields: list[tuple], oneof: str | None = None) -> None:
        msg = fdp.message_type.add(name=name)
        if oneof:
            msg.oneof_decl.add(name=oneof)
        for fname, number, ftype, label, type_name, in_oneof in fields:
            f = msg.field.add(
                name=fname, number=number, type=getattr(F, ftype), label=getattr(F, label)
            )
            if type_name:
                f.type_name = f".ChakraProtoMsg.{type_name}"
            if in_oneof:
                f.oneof_index = 0

    attr_fields = [
        ("name", 1, "TYPE_STRING", "LABEL_OPTIONAL", None, False),
        ("doc_string", 2, "TYPE_STRING", "LABEL_OPTIONAL", None, False),
    ]
    for n, (scalar, ftype) in enumerate(_SCALARS):
        list_name = scalar.capitalize() + "List"
        attr_fields.append((f"{scalar}_val", 3 + 2 * n, ftype, "LABEL_OPTIONAL", None, True))
        attr_fields.append(
            (f"{scalar}_list", 4 + 2 * n, "TYPE_MESSAGE", "LABEL_OPTIONAL", list_name, True)
        )
    message("AttributeProto", attr_fields, oneof="value")
    for scalar, ftype in _SCALARS:
        message(scalar.capitalize() + "List", [("values", 1, ftype, "LABEL_REPEATED", None, False)])
    message(
        "GlobalMetadata",
        [
            ("version", 1, "TYPE_STRING", "LABEL_OPTIONAL", None, False),
            ("attr", 2, "TYPE_MESSAGE", "LABEL_REPEATED", "AttributeProto", False),
        ],
    )
    for enum_name, values in (("NodeType", NODE_TYPES), ("CollectiveCommType", COMM_TYPES)):
        enum = fdp.enum_type.add(name=enum_name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    message(
        "Node",
        [
            ("id", 1, "TYPE_UINT64", "LABEL_OPTIONAL", None, False),
            ("name", 2, "TYPE_STRING", "LABEL_OPTIONAL", None, False),
            ("type", 3, "TYPE_ENUM", "LABEL_OPTIONAL", "NodeType", False),
            ("ctrl_deps", 4, "TYPE_UINT64", "LABEL_REPEATED", None, False),
            ("data_deps", 5, "TYPE_UINT64", "LABEL_REPEATED", None, False),
            ("start_time_micros", 6, "TYPE_UINT64", "LABEL_OPTIONAL", None, False),
            ("duration_micros", 7, "TYPE_UINT64", "LABEL_OPTIONAL", None, False),
            ("inputs", 8, "TYPE_MESSAGE", "LABEL_OPTIONAL", "IOInfo", False),
            ("outputs", 9, "TYPE_MESSAGE", "LABEL_OPTIONAL", "IOInfo", False),
            ("attr", 10, "TYPE_MESSAGE", "LABEL_REPEATED", "AttributeProto", False),
        ],
    )
    message(
        "IOInfo",
        [
            ("values", 1, "TYPE_STRING", "LABEL_OPTIONAL", None, False),
            ("shapes", 2, "TYPE_STRING", "LABEL_OPTIONAL", None, False),
            ("types", 3, "TYPE_STRING", "LABEL_OPTIONAL", None, False),
        ],
    )
    # Node refers to IOInfo declared after it: fine in a descriptor (names resolve per file).
    return fdp


@functools.lru_cache(maxsize=1)
def load_schema() -> ChakraSchema:
    """Build (once) the Chakra message classes in a private descriptor pool.

    Raises:
        ImportError: ``protobuf`` is not installed (``pip install 'scaleout[chakra]'``).
    """
    try:
        from google.protobuf import descriptor_pool, message_factory
    except ImportError as err:
        raise ImportError(
            "Chakra traces need the 'protobuf' package: pip install 'scaleout[chakra]'"
        ) from err
    pool = descriptor_pool.DescriptorPool()
    pool.Add(_file_descriptor())

    def cls(name: str) -> Any:
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"ChakraProtoMsg.{name}"))

    from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

    return ChakraSchema(
        GlobalMetadata=cls("GlobalMetadata"),
        Node=cls("Node"),
        AttributeProto=cls("AttributeProto"),
        IOInfo=cls("IOInfo"),
        NodeType=EnumTypeWrapper(pool.FindEnumTypeByName("ChakraProtoMsg.NodeType")),
        CollectiveCommType=EnumTypeWrapper(
            pool.FindEnumTypeByName("ChakraProtoMsg.CollectiveCommType")
        ),
        lists={s: cls(s.capitalize() + "List") for s, _ in _SCALARS},
    )


def make_attr(name: str, value: object) -> Any:
    """An ``AttributeProto``: bool, int, float, str -> bool_val, int64_val, double_val, string_val.

    Raises:
        TypeError: another type of value.
    """
    schema = load_schema()
    if isinstance(value, bool):
        return schema.AttributeProto(name=name, bool_val=value)
    if isinstance(value, int):
        return schema.AttributeProto(name=name, int64_val=value)
    if isinstance(value, float):
        return schema.AttributeProto(name=name, double_val=value)
    if isinstance(value, str):
        return schema.AttributeProto(name=name, string_val=value)
    raise TypeError(
        f"attribute {name!r}: expected bool, int, float or str, got {type(value).__name__}"
    )


def attributes(node: Any) -> dict[str, Any]:
    """A node's (or metadata's) attributes as ``{name: value}`` (lists as Python lists)."""
    out = {}
    for attr in node.attr:
        which = attr.WhichOneof("value")
        if which is None:
            continue
        value = getattr(attr, which)
        out[attr.name] = list(value.values) if which.endswith("_list") else value
    return out


def _node_label(node: Any) -> str:
    return f"node {node.id} ({node.name!r})"


def _bad(node: Any, key: str, expected: str, value: object) -> ValueError:
    return ValueError(f"{_node_label(node)}: {key} must be {expected}, got {value!r}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_seconds_or_bytes(node: Any, attrs: dict, key: str, unit: str) -> None:
    """``attrs[key]``, when present: a finite number >= 0."""
    if key in attrs:
        value = attrs[key]
        if not _number(value) or not 0 <= value < math.inf:
            raise _bad(node, key, f"a finite number of {unit} >= 0", value)


def _check_node(node: Any, attrs: dict, schema: ChakraSchema) -> None:
    """The attributes the executor (``scaleout.sim.graph``) reads from ``node``."""
    if node.type not in schema.NodeType.values():
        raise _bad(node, "type", f"a NodeType ({', '.join(NODE_TYPES)})", node.type)
    kind = schema.NodeType.Name(node.type)
    if kind not in ("COMM_COLL_NODE", "COMM_SEND_NODE", "COMM_RECV_NODE"):
        _check_seconds_or_bytes(node, attrs, "duration_s", "seconds")
        return
    _check_seconds_or_bytes(node, attrs, "comm_size", "bytes")
    priority = attrs.get("comm_priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise _bad(node, "comm_priority", "an integer", priority)
    ctype = attrs.get("comm_type", 0)
    if kind == "COMM_COLL_NODE":
        if (not isinstance(ctype, int) or isinstance(ctype, bool)
                or ctype not in schema.CollectiveCommType.values()):
            names = ", ".join(f"{i} {name}" for i, name in enumerate(COMM_TYPES))
            raise _bad(node, "comm_type", f"a CollectiveCommType ({names})", ctype)
        _check_seconds_or_bytes(node, attrs, "codec_s", "seconds")
    # without a size a transfer was priced as 0 s, silently (a barrier moves no payload)
    if "comm_size" not in attrs and not (kind == "COMM_COLL_NODE" and ctype == _BARRIER):
        raise ValueError(f"{_node_label(node)}: a {kind} needs comm_size (bytes on the wire), "
                         "and has none")


def _cycle(left: dict[int, Any]) -> str:
    """A cycle among ``left`` (nodes that never became ready), as ``node a -> node b -> a``."""
    node = next(iter(left.values()))
    seen: list[int] = []
    while node.id not in seen:  # follow dependencies that never ran: they end in a cycle
        seen.append(node.id)
        node = left[next(d for d in (*node.data_deps, *node.ctrl_deps) if d in left)]
    loop = seen[seen.index(node.id):]
    return " -> ".join([_node_label(left[i]) for i in loop] + [f"node {node.id}"])


def check_nodes(nodes: Sequence[Any], source: str = "") -> None:
    """Check one rank's nodes before they run: at least one node, unique ids, dependencies on
    nodes that exist and no cycle, a known node type, and the attributes that are read sound:
    ``duration_s`` of a compute node, ``comm_size`` (bytes: required but for a barrier) and
    ``comm_priority`` (an integer) of a communication node, ``comm_type`` (a CollectiveCommType) and ``codec_s`` of a
    collective; times and sizes finite and >= 0.

    Args:
        nodes: ``Node`` messages.
        source: a prefix for the errors (the file's path).

    Raises:
        ValueError: the first problem, naming the node, the attribute and the value.
    """
    where = f"{source}: " if source else ""
    if not nodes:
        raise ValueError(f"{where}the Chakra trace has no nodes (only its GlobalMetadata)")
    schema = load_schema()
    by_id: dict[int, Any] = {}
    for node in nodes:
        if node.id in by_id:
            raise ValueError(f"{where}node id {node.id} appears twice ({by_id[node.id].name!r} and "
                             f"{node.name!r}): Chakra node ids must be unique")
        by_id[node.id] = node
    waiting: dict[int, int] = {}
    children: dict[int, list[int]] = {i: [] for i in by_id}
    for node in nodes:
        try:
            _check_node(node, attributes(node), schema)
        except ValueError as err:
            raise ValueError(f"{where}{err}") from None
        deps = set(node.data_deps) | set(node.ctrl_deps)
        missing = deps - by_id.keys()
        if missing:
            raise ValueError(
                f"{where}{_node_label(node)} depends on missing nodes {sorted(missing)}"
            )
        waiting[node.id] = len(deps)
        for dep in deps:
            children[dep].append(node.id)
    ready = [i for i, count in waiting.items() if not count]
    while ready:
        for child in children[ready.pop()]:
            waiting[child] -= 1
            if not waiting[child]:
                ready.append(child)
    left = {i: by_id[i] for i, count in waiting.items() if count}
    if left:
        raise ValueError(f"{where}{len(left)} Chakra nodes can never run: the dependencies form "
                         f"a cycle: {_cycle(left)}")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _messages(data: bytes, path: str) -> Iterator[bytes]:
    pos = 0
    while pos < len(data):
        size, shift = 0, 0
        while True:
            if pos >= len(data) or shift > 35:
                raise ValueError(f"{path}: truncated or corrupt length prefix at byte {pos}")
            byte = data[pos]
            pos += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if pos + size > len(data):
            raise ValueError(f"{path}: message of {size} bytes at byte {pos} runs past the end")
        yield data[pos : pos + size]
        pos += size


def et_path(prefix: str | os.PathLike, rank: int) -> str:
    """``prefix.<rank>.et``."""
    return f"{os.fspath(prefix)}.{rank}.et"


def write_et(path: str | os.PathLike, metadata: Any, nodes: Iterable[Any]) -> None:
    """Write a ``GlobalMetadata`` then ``nodes``, each varint32-length-prefixed."""
    with open(path, "wb") as f:
        for message in (metadata, *nodes):
            payload = message.SerializeToString()
            f.write(_varint(len(payload)) + payload)


def read_et(path: str | os.PathLike) -> tuple[Any, list[Any]]:
    """Read one rank's file: ``(GlobalMetadata, [Node, ...])``, checked (:func:`check_nodes`).

    Raises:
        ValueError: an empty, truncated or unparsable file, or nodes that cannot run as they
            are (the path is named).
    """
    schema = load_schema()
    from google.protobuf.message import DecodeError

    with open(path, "rb") as f:
        data = f.read()
    chunks = list(_messages(data, os.fspath(path)))
    if not chunks:
        raise ValueError(f"{os.fspath(path)}: empty Chakra trace (expected GlobalMetadata first)")
    try:
        metadata = schema.GlobalMetadata.FromString(chunks[0])
        nodes = [schema.Node.FromString(chunk) for chunk in chunks[1:]]
    except DecodeError as err:
        raise ValueError(f"{os.fspath(path)}: not a Chakra trace: {err}") from err
    check_nodes(nodes, os.fspath(path))
    return metadata, nodes
