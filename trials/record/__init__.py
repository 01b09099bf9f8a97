"""The record: every field declared once (``fields``), and how a record reaches disk (``atomic``).

    fields  the record's fields with type, meaning and who sets them; the store's Parquet schema, the
            validation and docs/guide/record-fields.md derive from them
    atomic  temporary file, fsync, rename: a reader never sees half a record, report or table

May import: ``trials.typecheck`` and ``trials.measure.kernels``' kernel classes (field names). Nothing heavy:
the driver reads the declaration without importing torch.
"""
