"""The CF over a Unix-domain socket: the embedded CF's socket (cfemu.embedded, unix_socket=True), unix:// URLs
(cfemu.connection.connect), the role's credentials in them (cfemu.credentials), and the one-line errors of bad ones.
Real redis-server processes; the member, backup and restore over the socket: tests/qsg/test_cf_unix_socket.py."""

from __future__ import annotations

import os
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from cfemu import credentials
from cfemu.connection import ConnectionConfigError, connect
from cfemu.embedded import SOCKET_DIR_PREFIX, SOCKET_NAME, EmbeddedRedis, socket_url
from cfemu.settings import cluster_cf_url
from tests.support.waits import sigstop

HARNESS_USER, HARNESS_PW = "harness", "harness-pw"  # a user that may list the CF's clients (no role may)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (pytest's own may be too long for a socket address), removed after."""
    d = Path(tempfile.mkdtemp(prefix="cfu-"))
    try:
        yield d
    finally:
        import shutil
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def secured_cf(short_dir: Path, tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, dict[str, str]]]:
    """A CF secured as a group's (the default user off, one user per role), listening on its socket too."""
    passwords = credentials.create(tmp_path / "secrets")
    cf = EmbeddedRedis(data_dir=short_dir / "cf", unix_socket=True,
                       acl_users=[*credentials.acl_lines(passwords), f"user {HARNESS_USER} on >{HARNESS_PW} ~* &* +@all"])
    cf.start()
    try:
        yield cf, passwords
    finally:
        cf.stop()


def test_the_socket_is_its_owners_only_and_asks_for_the_same_passwords(
        secured_cf: tuple[EmbeddedRedis, dict[str, str]]) -> None:
    cf, passwords = secured_cf
    path = cf.socket_path
    assert path == cf.data_dir / SOCKET_NAME
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    member = connect(credentials.with_user(cf.unix_url, "member", passwords["member"]))
    assert member.ping() is True
    harness = cf.client(username=HARNESS_USER, password=HARNESS_PW)
    (entry,) = [c for c in harness.client_list() if c["user"] == credentials.user("member")]
    assert str(path) in entry["addr"], entry  # it came in over the socket, not over TCP
    harness.close()
    member.close()
    with pytest.raises(redis.exceptions.AuthenticationError):  # the default user is off here as over TCP
        connect(cf.unix_url).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        connect(credentials.with_user(cf.unix_url, "member", "not-the-password")).ping()


def test_a_restarted_cf_listens_on_the_same_socket_and_clients_reconnect(
        secured_cf: tuple[EmbeddedRedis, dict[str, str]]) -> None:
    cf, passwords = secured_cf
    client = connect(credentials.with_user(cf.unix_url, "member", passwords["member"]))
    client.set("k", "v")
    path = cf.socket_path
    cf.kill()
    with pytest.raises(redis.exceptions.ConnectionError):
        client.get("k")
    cf.start()
    assert cf.socket_path == path
    assert client.get("k") is None  # the same client, a new connection, to the CF that came back empty
    client.close()


def test_a_blocked_cf_times_out_over_the_socket_as_over_tcp(
        secured_cf: tuple[EmbeddedRedis, dict[str, str]]) -> None:
    """The socket blocks with the kernel timing out a receive (as over TCP): a CF that does not answer is a
    TimeoutError after socket_timeout, never a hang; the client serves again once the CF does."""
    cf, passwords = secured_cf
    client = connect(credentials.with_user(cf.unix_url, "member", passwords["member"]), socket_timeout=0.5)
    client.ping()
    conn = client.connection_pool.get_connection()
    assert type(conn).__name__ == "_KernelTimeoutUnixConnection"
    client.connection_pool.release(conn)
    assert cf.pid is not None
    sigstop(cf.pid)
    try:
        t0 = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            client.get("k")
        assert 0.4 < time.monotonic() - t0 < 10
    finally:
        os.kill(cf.pid, signal.SIGCONT)
    assert client.ping() is True
    client.close()


def test_a_data_directory_too_long_for_a_socket_address_gets_a_private_one(
        short_dir: Path, tmp_path: Path) -> None:
    deep = short_dir / ("d" * 100)
    cf = EmbeddedRedis(data_dir=deep, unix_socket=True, requirepass="pw")
    cf.start()
    try:
        path = cf.socket_path
        assert path is not None and path.parent.name.startswith(SOCKET_DIR_PREFIX)
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
        assert connect(cf.unix_url).ping() is True
    finally:
        cf.stop()
    assert not path.parent.exists()  # its own directory goes with it
    again = EmbeddedRedis(data_dir=deep, unix_socket=path, requirepass="pw")  # a restart where it listened before
    again.start()
    try:
        assert again.socket_path == path and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
        assert connect(again.unix_url).ping() is True
    finally:
        again.stop()
    assert not path.parent.exists()


def test_a_socket_directory_others_may_enter_is_refused(short_dir: Path) -> None:
    shared = short_dir / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    cf = EmbeddedRedis(data_dir=short_dir / "cf", unix_socket=shared / "cf.sock")
    with pytest.raises(ValueError, match="must be its owner's only"):
        cf.start()
    assert not cf.is_running()


def test_a_cf_with_tls_has_no_socket_beside_its_tls_port(short_dir: Path) -> None:
    """A socket in clear would let a local client in without the client certificate the TLS port asks for."""
    with pytest.raises(ValueError, match="TLS port only"):
        EmbeddedRedis(data_dir=short_dir / "cf", tls_cert=short_dir / "c.pem", tls_key=short_dir / "c.key",
                      tls_ca=short_dir / "ca.pem", unix_socket=True)


def test_a_detached_cf_is_found_again_with_its_socket(short_dir: Path) -> None:
    cf = EmbeddedRedis(data_dir=short_dir / "cf", unix_socket=True, requirepass="pw", detach=True).start()
    try:
        again = EmbeddedRedis.attach(short_dir / "cf")
        assert again.socket_path == cf.socket_path
        assert connect(again.unix_url).ping() is True
    finally:
        cf.stop()


def test_a_cluster_file_names_the_socket_its_processes_use() -> None:
    state = {"redis_url": "redis://127.0.0.1:6379/0", "cf": {"dir": "/x", "socket": "/run/g/cf.sock"}}
    assert cluster_cf_url(state) == "unix:///run/g/cf.sock?db=0"
    assert cluster_cf_url({"redis_url": "redis://127.0.0.1:6379/0", "cf": {"dir": "/x"}}) == \
        "redis://127.0.0.1:6379/0"


def test_the_roles_credentials_go_into_a_unix_url_and_out_of_its_messages() -> None:
    url = credentials.with_user(socket_url("/run/g/cf.sock"), "member", "p/w:@")
    assert url == "unix://qsg-member:p%2Fw%3A%40@/run/g/cf.sock?db=0"
    assert credentials.redact(url) == "unix://qsg-member:***@/run/g/cf.sock?db=0"
    assert credentials.with_user("unix://other:x@/run/g/cf.sock", "member", "pw") == "unix://other:x@/run/g/cf.sock"


@pytest.fixture
def not_sockets(short_dir: Path) -> Callable[[str], str]:
    (short_dir / "file").write_text("not a socket")
    (short_dir / "dir").mkdir()
    return lambda name: f"unix://{short_dir / name}"


@pytest.mark.parametrize(("name", "problem"), [
    ("missing.sock", "the file does not exist"),
    ("file", "is a regular file, not a Unix-domain socket"),
    ("dir", "is a directory, not a Unix-domain socket"),
])
def test_a_url_that_names_no_socket_is_a_one_line_error(not_sockets: Callable[[str], str], name: str,
                                                          problem: str) -> None:
    with pytest.raises(ConnectionConfigError) as e:
        connect(not_sockets(name).replace("unix://", "unix://qsg-member:secret@"))
    text = str(e.value)
    assert problem in text and name in text and "\n" not in text and "secret" not in text


def test_a_relative_or_too_long_socket_path_is_a_one_line_error(short_dir: Path) -> None:
    with pytest.raises(ConnectionConfigError, match="by its absolute path"):
        connect("unix://cf.sock")
    with pytest.raises(ConnectionConfigError, match="holds at most 107"):
        connect(f"unix://{short_dir / ('s' * 120)}")


def test_a_listening_socket_that_is_not_the_cfs_fails_on_the_first_command(short_dir: Path) -> None:
    """A socket file nobody listens on any more (a CF killed with -9 leaves it) is a connection error, as a
    closed TCP port is: the CF may come back, so it is no configuration error."""
    path = short_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
    client = connect(f"unix://{path}", socket_connect_timeout=2)
    with pytest.raises(redis.exceptions.ConnectionError, match="stale.sock"):
        client.ping()
