"""Which MLflow tracking URIs JuicyTalk can write to, checked before Ray or any trial starts.

The ``mlflow`` extra is ``mlflow-skinny`` plus SQLAlchemy and Alembic: enough for MLflow's SQL
store on SQLite (``sqlite:///path/mlflow.db``, what MLflow 3 recommends) and for a tracking server
(``http(s)://host:port``). MLflow 3 keeps its ``file:`` store only behind
``MLFLOW_ALLOW_FILE_STORE=true`` (set here when a user names one; anyone reading it back sets it too).
Other schemes (postgresql, mysql, databricks) need packages the extra does not bring.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

SCHEMES = {"sqlite": ("sqlalchemy", "alembic"), "http": (), "https": (), "file": ()}
USE = "use sqlite:///PATH/mlflow.db, http(s)://HOST:PORT or file:/PATH"


def scheme(uri: str) -> str:
    """The URI's scheme; a bare path is MLflow's file store."""
    return urlparse(uri).scheme.lower() if "://" in uri or uri.startswith("file:") else "file"


def problem(uri: str) -> str | None:
    """Why ``uri`` cannot be used here (one sentence), or None."""
    name = scheme(uri)
    if name not in SCHEMES:
        return f"scheme {name!r} of {uri!r} is not supported; {USE}"
    missing = [p for p in SCHEMES[name] if importlib.util.find_spec(p) is None]
    if missing:
        return f"{uri!r} needs the {' and '.join(missing)} package(s): pip install 'juicytalk[mlflow]'"
    if name == "sqlite" and not urlparse(uri).path.strip("/"):
        return f"{uri!r} names no database file; {USE}"
    return None


PROBE_S = 3.0  # how long a tracking server may take to accept a connection


def unreachable(uri: str, timeout_s: float = PROBE_S) -> str | None:
    """Why nothing answers at an http(s) ``uri`` (one sentence), or None. MLflow's client retries a server
    that is not there for minutes, then raises a traceback; a plain TCP connect says it in seconds."""
    if scheme(uri) not in ("http", "https"):
        return None
    parsed = urlparse(uri)
    host, port = parsed.hostname, parsed.port or (443 if scheme(uri) == "https" else 80)
    if not host:
        return f"{uri!r} names no host; {USE}"
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        return (f"nothing answers at {uri} ({exc.strerror or exc or 'timed out'}); start the server (mlflow server "
                f"--port {port}) or give a sqlite:///PATH/mlflow.db URI")
    return None


def prepare(uri: str) -> None:
    """Before MLflow opens ``uri``: a SQLite file's folder exists, a file store is allowed."""
    name = scheme(uri)
    if name == "sqlite":
        Path(urlparse(uri).path).parent.mkdir(parents=True, exist_ok=True)
    elif name == "file":
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
