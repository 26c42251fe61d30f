"""A throwaway PostgreSQL server for a test: Debian's package (``apt-get install postgresql``, as .ci/run
does), a fresh cluster in a temporary folder, listening on 127.0.0.1 only, with a password, stopped and
removed on exit.

PostgreSQL refuses to run as root: when the tests do, the cluster belongs to the package's ``postgres``
user and every server command runs as that user (``setpriv``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from merge_pipeline_tests.dagster.services import free_port


@dataclass(frozen=True)
class Postgres:
    host: str
    port: int
    user: str
    password: str
    database: str

    def env(self) -> dict[str, str]:
        """The variables the production dagster.yaml of docs/DAGSTER.md reads."""
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USER": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
        }


def server_bin() -> Path:
    """Debian keeps initdb and pg_ctl in /usr/lib/postgresql/<major>/bin, off PATH: the newest there."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    majors = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name))
    assert majors, "PostgreSQL's server is not installed: apt-get install -y postgresql (.ci/run does)"
    return majors[-1].parent


@contextlib.contextmanager
def running_postgres(database: str = "dagster") -> Iterator[Postgres]:
    bin_dir = server_bin()
    as_user = _as_server_user()
    folder = Path(tempfile.mkdtemp(prefix="postgres_", dir="/tmp"))  # pytest's own tmp folders are root's, 0700
    data, password = folder / "data", secrets.token_hex(16)
    (folder / "password").write_text(password)
    if as_user:
        os.chown(folder, as_user.pw_uid, as_user.pw_gid)
        os.chown(folder / "password", as_user.pw_uid, as_user.pw_gid)
    server = Postgres("127.0.0.1", free_port(), "dagster", password, database)

    def run(*command: str) -> None:
        prefix = ["setpriv", f"--reuid={as_user.pw_uid}", f"--regid={as_user.pw_gid}", "--clear-groups"]
        done = subprocess.run(
            [*(prefix if as_user else []), str(bin_dir / command[0]), *command[1:]],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{command[0]}: {done.stdout[-2000:]}{done.stderr[-2000:]}"

    started = False
    try:
        # Password logins over TCP (as Dagster's processes connect); no password on its own socket, for createdb.
        run(
            "initdb", "-D", str(data), "-U", server.user, f"--pwfile={folder / 'password'}", "--auth-host=scram-sha-256"
        )
        options = f"-c listen_addresses={server.host} -p {server.port} -c unix_socket_directories={folder}"
        run("pg_ctl", "-D", str(data), "-l", str(folder / "server.log"), "-o", options, "-w", "start")
        started = True
        run("createdb", "-h", str(folder), "-p", str(server.port), "-U", server.user, database)
        yield server
    finally:
        if started:
            run("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)


def _as_server_user() -> pwd.struct_passwd | None:
    """The user the server runs as when this process is root: the package's ``postgres``, else ``nobody``."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise AssertionError("running as root, and no postgres or nobody user to run PostgreSQL as")
