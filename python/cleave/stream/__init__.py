"""Streamed row updates through Kafka (docs/streaming.md): the record format
(`encode_record`, `decode_record`) and the consumer behind `cleave stream`
(cleave.stream.consumer)."""

from cleave.stream.record import Record, RecordError, decode_record, encode_record, record_key

__all__ = ["Record", "RecordError", "decode_record", "encode_record", "record_key"]
