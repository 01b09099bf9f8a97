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


def prepare(uri: str) -> None:
    """Before MLflow opens ``uri``: a SQLite file's folder exists, a file store is allowed."""
    name = scheme(uri)
    if name == "sqlite":
        Path(urlparse(uri).path).parent.mkdir(parents=True, exist_ok=True)
    elif name == "file":
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
