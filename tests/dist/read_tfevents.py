#!/usr/bin/python3
"""Reads TensorBoard event files with Google's protobuf runtime and crcmod's
CRC-32C, independently of meshtrain's writer: checks every record's two masked
checksums and prints each scalar as "tag step value" (value with repr's 17 digits).

    read_tfevents.py FILE...
"""
import struct
import sys

import crcmod.predefined
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

crc32c = crcmod.predefined.mkCrcFun("crc-32c")


def masked(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def event_class():
    """tensorflow.Event with the fields of TensorBoard's event.proto and summary.proto that scalars use."""
    f = descriptor_pb2.FileDescriptorProto(name="event.proto", package="tensorflow", syntax="proto3")
    F = descriptor_pb2.FieldDescriptorProto
    summary = f.message_type.add(name="Summary")
    value = summary.nested_type.add(name="Value")
    value.field.add(name="tag", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=F.TYPE_FLOAT, label=F.LABEL_OPTIONAL)
    summary.field.add(name="value", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                      type_name=".tensorflow.Summary.Value")
    event = f.message_type.add(name="Event")
    event.field.add(name="wall_time", number=1, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    event.field.add(name="file_version", number=3, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    event.field.add(name="summary", number=5, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
                    type_name=".tensorflow.Summary")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    descriptor = pool.FindMessageTypeByName("tensorflow.Event")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)


def main():
    Event = event_class()
    for path in sys.argv[1:]:
        data = open(path, "rb").read()
        at, first = 0, True
        while at < len(data):
            header = data[at:at + 8]
            (length,) = struct.unpack("<Q", header)
            (length_crc,) = struct.unpack("<I", data[at + 8:at + 12])
            body = data[at + 12:at + 12 + length]
            (body_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
            if masked(header) != length_crc or masked(body) != body_crc:
                sys.exit(f"{path}: record at byte {at}: checksum mismatch")
            at += 16 + length
            e = Event()
            e.ParseFromString(body)
            if first and e.file_version != "brain.Event:2":
                sys.exit(f"{path}: the first event is not file_version brain.Event:2")
            first = False
            for v in e.summary.value:
                print(v.tag, e.step, repr(v.simple_value))


if __name__ == "__main__":
    main()
