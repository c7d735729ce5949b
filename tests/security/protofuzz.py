"""Hypothesis strategies built from protobuf descriptors: any message the wire can carry.

Every field of the message (and, to a bounded depth, of the messages it contains) is either left
unset or filled with a value of its declared type, including out-of-range enum numbers, negative
ids, NaN and infinite floats, empty and non-ASCII strings, and random bytes. One member of each
oneof at most is set, as on the wire. Nothing here knows the rollout semantics: the strategies
follow the contract's shape, not what the server accepts.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor, message_factory
from google.protobuf.message import Message
from hypothesis import strategies as st

FD = descriptor.FieldDescriptor

_INT32 = st.integers(-(2**31), 2**31 - 1)
_INT64 = st.integers(-(2**63), 2**63 - 1)
_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FD.TYPE_INT32: st.one_of(st.integers(-4, 4096), _INT32),
    FD.TYPE_SINT32: _INT32,
    FD.TYPE_SFIXED32: _INT32,
    FD.TYPE_INT64: st.one_of(st.integers(-4, 64), _INT64),
    FD.TYPE_SINT64: _INT64,
    FD.TYPE_SFIXED64: _INT64,
    FD.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FD.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    FD.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FD.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_FLOAT: st.floats(width=32),
    FD.TYPE_DOUBLE: st.floats(),
    FD.TYPE_STRING: st.text(max_size=24),
    FD.TYPE_BYTES: st.binary(max_size=64),
}


def _value(field: descriptor.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FD.TYPE_ENUM:
        assert field.enum_type is not None
        numbers = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.integers(-3, 64))
    if field.type == FD.TYPE_MESSAGE:
        assert field.message_type is not None
        return messages(field.message_type, depth + 1)
    return _SCALARS[field.type]


def _is_map(field: descriptor.FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def messages(desc: descriptor.Descriptor, depth: int = 0, max_depth: int = 4) -> st.SearchStrategy[Message]:
    """A strategy of `desc` messages with random subsets of fields set, to `max_depth` nesting."""
    cls = message_factory.GetMessageClass(desc)
    if depth > max_depth:
        return st.just(cls())
    oneof_fields = {f.name for o in desc.oneofs for f in o.fields}
    plain = [f for f in desc.fields if f.name not in oneof_fields]

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = cls()
        for field in plain:
            if not draw(st.booleans()):
                continue
            _set(draw, message, field, depth)
        for oneof in desc.oneofs:
            choice = draw(st.sampled_from([None, *oneof.fields]))
            if choice is not None:
                _set(draw, message, choice, depth, force=True)
        return message

    return build()


def _set(
    draw: st.DrawFn, message: Message, field: descriptor.FieldDescriptor, depth: int, force: bool = False
) -> None:
    if _is_map(field):
        assert field.message_type is not None
        key_field = field.message_type.fields_by_name["key"]
        value_field = field.message_type.fields_by_name["value"]
        entries = draw(st.dictionaries(_SCALARS[key_field.type], _value(value_field, depth), max_size=4))
        target = getattr(message, field.name)
        for key, value in entries.items():
            if value_field.type == FD.TYPE_MESSAGE:
                target[key].CopyFrom(value)
            else:
                target[key] = value
        return
    if field.is_repeated:
        values = draw(st.lists(_value(field, depth), max_size=4))
        target = getattr(message, field.name)
        if field.type == FD.TYPE_MESSAGE:
            for value in values:
                target.add().CopyFrom(value)
        else:
            target.extend(values)
        return
    value = draw(_value(field, depth))
    if field.type == FD.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(value)
        if force:
            getattr(message, field.name).SetInParent()
    else:
        setattr(message, field.name, value)
