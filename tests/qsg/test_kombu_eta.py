"""Tasks with an ETA or a countdown do not stall the tasks due now. Celery holds such a task unacknowledged until
it is due, and raises its consumer's prefetch count by one for each, so that other tasks keep coming (kombu's own
virtual transports honour any prefetch count). The transport caps a consumer's prefetch count at ``max_unacked``
(each unacknowledged delivery holds a member connection), but not what Celery raised it by since: capped, a worker
holding ``max_unacked`` delayed tasks took no task due now until one of them was due. A real group, kombu, and a
real ``celery worker`` process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

kombu = pytest.importorskip("kombu")
pytest.importorskip("celery")

import qsg.kombu_transport as kt  # noqa: E402
from qsg.local_group import LocalGroup  # noqa: E402
from tests.qsg import celery_app  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGroup]:
    g = LocalGroup.up(tmp_path_factory.mktemp("keta") / "g", managers=1, backup_interval=None)
    try:
        yield g
    finally:
        g.down()


def url_and_options(g: LocalGroup, **extra: Any) -> tuple[str, dict[str, Any]]:
    url = kt.members_url([(h, p) for _, h, p in g.endpoints], g.token or "")
    return url, {"operator_token": g.operator_token, "polling_interval": 0.05, **extra}


def drain(conn: Any, times: int) -> None:
    for _ in range(times):
        try:
            conn.drain_events(timeout=0.2)
        except TimeoutError:
            pass


def test_a_prefetch_count_raised_above_the_first_gets_its_rise(group: LocalGroup) -> None:
    """Celery's mechanism, by hand: a consumer whose first prefetch count is at ``max_unacked`` holds that many;
    raised by one (a delayed task held), it gets one more; lowered again, it holds its first count; a first
    prefetch count above ``max_unacked`` still holds ``max_unacked``."""
    url, options = url_and_options(group, max_unacked=2)
    got: list[Any] = []
    with kombu.Connection(url, transport_options=options) as conn:
        queue = kombu.Queue("ketaq", routing_key="ketaq")
        with conn.Producer() as producer:
            for n in range(6):
                producer.publish({"n": n}, routing_key="ketaq", declare=[queue])
        with conn.Consumer(queue, callbacks=[lambda body, message: got.append(message)],
                           prefetch_count=2) as consumer:
            drain(conn, 5)
            assert len(got) == 2
            consumer.qos(prefetch_count=3)  # what Celery does for a task with an ETA it holds
            drain(conn, 5)
            assert len(got) == 3
            consumer.qos(prefetch_count=2)  # the delayed task ran: back to the first count
            got.pop().ack()
            drain(conn, 5)
            assert len(got) == 2
            for m in got:
                m.ack()
    got.clear()
    with kombu.Connection(url, transport_options=options) as conn:
        queue = kombu.Queue("ketaq", routing_key="ketaq")
        with conn.Consumer(queue, callbacks=[lambda body, message: got.append(message)], prefetch_count=50):
            drain(conn, 5)
            assert len(got) == 2  # a first count above max_unacked: max_unacked
            for m in got:
                m.ack()


def test_a_raised_prefetch_count_adds_at_most_max_raised() -> None:
    """A consumer that raises its prefetch count far above its first (a plain basic_qos, or Celery holding many
    delayed tasks) holds at most ``max_raised`` more than ``max_unacked``: each delivery is one of the member
    connections its whole host may open, and one consumer must not take them all."""
    from types import SimpleNamespace

    channel = SimpleNamespace(transport=SimpleNamespace(max_unacked=16, max_raised=4), do_restore=False)
    qos = kt.QoS(channel, 1)
    assert qos._limit() == 1
    qos.prefetch_count = 500
    assert qos._limit() == 1 + 4
    qos.prefetch_count = 3
    assert qos._limit() == 1 + 2
    url = kt.members_url([("127.0.0.1", 1)], "token")
    with kombu.Connection(url, transport_options={"max_unacked": 8}) as conn:  # made, never connected
        assert conn.transport.max_raised == 32  # by default four times max_unacked
    with kombu.Connection(url, transport_options={"max_raised": 0}) as conn, pytest.raises(ValueError,
                                                                                            match="max_raised"):
        conn.transport  # noqa: B018 - made on first use, its options checked then


def test_a_celery_worker_holding_delayed_tasks_runs_the_tasks_due_now(group: LocalGroup, tmp_path: Path) -> None:
    """A worker with prefetch 1 and ``max_unacked`` 2 gets four tasks with a countdown of two minutes, then tasks
    due now: it runs those at once."""
    url, options = url_and_options(group, max_unacked=2)
    db_path = tmp_path / "tasks.db"
    celery_app.open_db(str(db_path)).close()
    with celery_app.app.connection_for_write(url, transport_options=options) as conn:
        conn.SimpleQueue(celery_app.QUEUE).close()  # declares the task queue (the operator token)
        for n in range(4):
            celery_app.record.apply_async((100 + n, str(db_path)), kwargs={"seconds": 0}, countdown=120,
                                          retry=True, connection=conn)
        for n in range(3):
            celery_app.record.apply_async((n, str(db_path)), kwargs={"seconds": 0}, retry=True, connection=conn)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CFEMU_CELERY_BROKER": url,
           "CFEMU_CELERY_OPTIONS": json.dumps(options)}
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.qsg.celery_app", "worker", "--pool", "solo",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-Q", celery_app.QUEUE,
             "--loglevel", "INFO"], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and worker.poll() is None:
            with celery_app.open_db(str(db_path)) as db:
                done = sorted(n for (n,) in db.execute("SELECT n FROM done"))
            if done == [0, 1, 2]:
                break
            time.sleep(0.3)
        assert done == [0, 1, 2], (f"the tasks due now done: {done}\n"
                                   f"{log_path.read_text(errors='replace')[-3000:]}")
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)  # warm shutdown: the delayed tasks go back to the queue
            try:
                worker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        worker.wait(timeout=10)
