"""The sweep lock's object on S3, written with S3's conditional writes: ``If-None-Match: *`` creates it only where
there is none, ``If-Match: <ETag>`` replaces or deletes it only where it is still the version read. pyarrow (the
store's filesystem) has no conditional write, so this one object goes through boto3, opened with the endpoint, region
and keys that pyarrow opened the bucket with (and, where those are not given, the same environment: credentials,
``AWS_ENDPOINT_URL``)."""

from __future__ import annotations

from typing import Any

from ..store import Store
from .base import Held, LockUnavailable, lock_path

_CHANGED = ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404", "412", "409")


class S3Slot:
    """``s3://bucket/prefix/.<sweep>.lock`` (see :class:`~.base.Slot`)."""

    def __init__(self, store: Store):
        try:
            import boto3
            from botocore.exceptions import BotoCoreError, ClientError
        except ImportError:
            raise LockUnavailable(f"sweep directory {store.url()}: a sweep on s3:// locks it with S3's conditional "
                                  "writes through boto3, which is not installed: pip install 'juicytalk[s3]'") from None
        self._errors = (BotoCoreError, ClientError)
        self.bucket, _, self.key = lock_path(store).partition("/")
        # the options pyarrow opened the bucket with; its pickle state is the one public view of all of them
        opts: dict[str, Any] = store.fs.__reduce__()[1][0]
        endpoint = opts.get("endpoint_override") or None
        if endpoint and "://" not in endpoint:
            endpoint = f"{opts.get('scheme') or 'https'}://{endpoint}"
        self.client = boto3.client(  # boto3's default session: its service models are read once a process
            "s3", endpoint_url=endpoint, region_name=opts.get("region") or None,
            aws_access_key_id=opts.get("access_key") or None, aws_secret_access_key=opts.get("secret_key") or None,
            aws_session_token=opts.get("session_token") or None)

    def _call(self, op: str, **kw: Any) -> dict | None:
        """The response; None where a condition failed or the object is not there; OSError where S3 does not
        answer or refuses otherwise (a missing bucket, no credentials), in one line."""
        try:
            return getattr(self.client, op)(Bucket=self.bucket, Key=self.key, **kw)
        except self._errors as exc:
            error = getattr(exc, "response", {}).get("Error", {})
            if error.get("Code") in _CHANGED:
                return None
            detail = f"{error.get('Code')}: {error.get('Message')}" if error else str(exc)
            raise OSError(f"s3://{self.bucket}/{self.key}: {op}: {detail}") from None

    def read(self) -> Held | None:
        got = self._call("get_object")
        if got is None:
            return None
        with got["Body"] as body:
            return Held(body.read(), got["ETag"])

    def create(self, data: bytes) -> str | None:
        put = self._call("put_object", Body=data, IfNoneMatch="*")
        return put and put["ETag"]

    def replace(self, data: bytes, version: str) -> str | None:
        put = self._call("put_object", Body=data, IfMatch=version)
        return put and put["ETag"]

    def delete(self, version: str) -> bool:
        return self._call("delete_object", IfMatch=version) is not None
