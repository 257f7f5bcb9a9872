"""format("equeue") through a broker (equeue/spark/viabroker.py, brokersink.py,
brokerread.py): a real `equeue serve` subprocess on a Unix socket with a token, the
session's local[2] Spark; the tasks reach the store only through the client."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from server_helpers import short_dir

from equeue.client.sync import Client
from equeue.errors import DataLossError, EQueueError, SparkOptionError
from equeue.spark.brokersink import EqueueBrokerWriter, chunks
from equeue.spark.stream import QueueRange, StreamOptions, read_range
from equeue.store.types import Message, OutgoingMessage

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

TOKEN = "s3cret-token"
FRAME = 256 * 1024  # the broker's max_frame_bytes: a task's rows need several requests


# Where a row of the streaming test came from, as a property of the row it writes.
FROM = (
    "map('from', concat(cast(queue_id as string), '/', cast(queue_offset as string))) as properties"
)


class Broker:
    def __init__(self, home: Path, *extra: str) -> None:
        self.store = home / "s"
        self.token_file = home / "token"
        self.token_file.write_text(TOKEN + "\n")
        self.token_file.chmod(0o600)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "equeue", "serve", str(self.store), "--quiet",
             "--token-file", str(self.token_file), "--max-frame-bytes", str(FRAME), *extra],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode()
        if not line.startswith("listening on "):
            self.stop()
            raise AssertionError(f"the broker did not start: {line!r}")
        self.url = line.split()[-1]

    def client(self) -> Client:
        return Client(self.url, token=TOKEN)

    def options(self) -> dict[str, str]:
        return {"broker": self.url, "tokenFile": str(self.token_file)}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def broker() -> Iterator[Broker]:
    home = short_dir()
    served = None
    try:
        served = Broker(home)
        yield served
    finally:
        if served is not None:
            served.stop()
        shutil.rmtree(home, ignore_errors=True)


def stored(client: Client, topic: str) -> dict[int, list[Message]]:
    """Every message of ``topic``, per queue, pulled through the broker."""
    out: dict[int, list[Message]] = {}
    for queue in client.queue_ids(topic):
        messages: list[Message] = []
        first, end = client.queue_range(topic, queue)
        offset = first
        for _ in range(10_000):  # bounded: at least one message a pull
            if offset >= end:
                break
            pulled = client.pull(topic, queue, offset, 512, max_bytes=FRAME // 2)
            messages += pulled.messages
            offset = pulled.next_offset
        out[queue] = messages
    return out


def spark_error(caught: pytest.ExceptionInfo[BaseException]) -> str:
    return str(caught.value)


def test_a_batch_write_through_the_broker_stores_every_row_once_in_queue_order(
    broker: Broker, spark: SparkSession
) -> None:
    rows = 2000
    df = spark.range(0, rows, numPartitions=2).selectExpr(
        "concat('k', cast(id % 7 as string)) as key",
        "concat(cast(id as string), ':', repeat('x', 500)) as body",
        "map('id', cast(id as string)) as properties",
    )
    with broker.client() as client:
        before = client.stats()["send_requests"]
        df.write.format("equeue").options(**broker.options()).option("topic", "w").mode(
            "append"
        ).save()
        requests = client.stats()["send_requests"] - before
        queues = stored(client, "w")
    ids = [int(m.properties["id"]) for msgs in queues.values() for m in msgs]
    assert sorted(ids) == list(range(rows))  # every row once
    for msgs in queues.values():
        for m in msgs:
            assert m.key == f"k{int(m.properties['id']) % 7}"
            assert m.body == f"{m.properties['id']}:".encode() + b"x" * 500
        # Spark's partitions are ids [0, 1000) and [1000, 2000): each in its order per queue.
        for low in (0, 1000):
            mine = [
                int(m.properties["id"]) for m in msgs if low <= int(m.properties["id"]) < low + 1000
            ]
            assert mine == sorted(mine)
    # ~1 MiB of rows in requests of at most half the broker's 256 KiB frame limit.
    assert requests >= 8
    # The batch source through the broker reads back the same messages, queue by queue.
    read = (
        spark.read.format("equeue").options(**broker.options()).option("topics", "w").load()
    ).collect()
    got = {(r.queue_id, r.queue_offset): (r.message_id, bytes(r.body), r.key) for r in read}
    want = {
        (q, m.queue_offset): (m.message_id, m.body, m.key) for q, ms in queues.items() for m in ms
    }
    assert got == want
    # Beside the broker (its writer), a read by path through read-only handles in Spark's
    # workers gives the same rows.
    by_path = spark.read.format("equeue").option("topics", "w").load(str(broker.store)).collect()
    assert {
        (r.queue_id, r.queue_offset): (r.message_id, bytes(r.body), r.key) for r in by_path
    } == want


def test_a_streaming_query_reads_and_writes_through_the_broker(
    broker: Broker, spark: SparkSession, tmp_path: Path
) -> None:
    with broker.client() as client:
        client.create_topic("src", 3)
        sent = client.send_batch(
            "src",
            [OutgoingMessage(f"b{i}".encode(), "", f"k{i}", None, 0, None) for i in range(300)],
        )
    query = (
        spark.readStream.format("equeue").options(**broker.options())
        .option("topics", "src").option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", 100).load()
        .selectExpr("key", "concat(body, cast('!' as binary)) as body", FROM)
        .writeStream.format("equeue").options(**broker.options()).option("topic", "dst")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True).start()
    )  # fmt: skip
    try:
        query.awaitTermination(120)
    finally:
        query.stop()
    assert query.exception() is None
    batches = [p["batchId"] for p in query.recentProgress if p["numInputRows"]]
    assert len(batches) >= 3  # maxOffsetsPerTrigger=100 over 300 offsets
    with broker.client() as client:
        out = [m for ms in stored(client, "dst").values() for m in ms]
    origin = {f"{r.queue_id}/{r.queue_offset}": r for r in sent}
    assert sorted(m.properties["from"] for m in out) == sorted(origin)  # each once
    for m in out:
        assert m.key is not None
        index = int(m.key[1:])
        assert m.body == f"b{index}!".encode()
        assert origin[m.properties["from"]].message_id == sent[index].message_id


def test_a_range_read_through_the_broker_keeps_fail_on_data_loss(broker: Broker) -> None:
    """Offsets planned that the queue does not hold (the writer lost them): DataLossError,
    or with failOnDataLoss=false a warning and the messages there are."""
    with broker.client() as client:
        client.create_topic("loss", 1)
        client.send_batch("loss", [b"a", b"b"])
    part = QueueRange("loss", 0, 1, 5)
    strict = StreamOptions({**broker.options(), "topics": "loss"})
    with pytest.raises(DataLossError, match=r"offsets 2 to 4 were planned but the queue ends at 2"):
        list(read_range(strict, part))
    lenient = StreamOptions({**broker.options(), "topics": "loss", "failOnDataLoss": "false"})
    batches = list(read_range(lenient, part))
    assert [bytes(b) for batch in batches for b in batch.column("body").to_pylist()] == [b"b"]


def test_a_range_of_wide_messages_is_read_in_pulls_that_fit_a_frame(broker: Broker) -> None:
    """Small bodies, large properties: 512 messages (the first guess for a 256 KiB frame)
    make a ~400 KiB answer, which the client refuses; the task pulls fewer at a time."""
    props = {"p": "v" * 700}
    with broker.client() as client:
        client.create_topic("wide", 1)
        for low in range(0, 1500, 200):  # requests within the frame
            batch = [{"body": b"%d" % i, "properties": props} for i in range(low, low + 200)]
            client.send_batch("wide", batch)
    options = StreamOptions({**broker.options(), "topics": "wide"})
    batches = list(read_range(options, QueueRange("wide", 0, 0, 1500)))
    bodies = [bytes(b) for batch in batches for b in batch.column("body").to_pylist()]
    assert bodies == [b"%d" % i for i in range(1500)]


def test_a_task_sends_requests_whose_answers_fit_a_frame(broker: Broker) -> None:
    """Tiny rows to a topic with a long name: a request of as many rows as fit half a
    frame would be answered with SendResults (each naming the topic) past the frame."""
    import pyarrow as pa
    from pyspark.sql.types import StringType, StructField, StructType

    topic = "t" * 200
    schema = StructType([StructField("body", StringType())])
    writer = EqueueBrokerWriter({**broker.options(), "topic": topic}, schema, False)
    rows = 6000
    sent = writer.write(iter([pa.record_batch([pa.array(["x"] * rows)], names=["body"])]))
    assert sent.rows == rows and sent.requests >= 4
    with broker.client() as client:
        assert sum(len(ms) for ms in stored(client, topic).values()) == rows


SMALL_BATCH = 100  # the broker's --max-batch-messages, far below the sink's 16,384 rows


@pytest.fixture(scope="module")
def small_batch_broker() -> Iterator[Broker]:
    home = short_dir()
    served = None
    try:
        served = Broker(home, "--max-batch-messages", str(SMALL_BATCH))
        yield served
    finally:
        if served is not None:
            served.stop()
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("properties", [0, 40])
def test_the_sink_cuts_requests_the_broker_takes_by_its_welcome(
    small_batch_broker: Broker, spark: SparkSession, properties: int
) -> None:
    """A broker taking 100 messages a request: the sink's requests hold at most that many
    rows; rows of 40 properties (89 msgpack objects each as the broker counts them, ~1 KiB)
    are cut further, below the broker's 3,200 objects a request past 64 KiB. Before, the
    tasks failed with LimitExceededError (16,384 rows a request; 100 rows of 89 objects)."""
    broker = small_batch_broker
    rows = 1000 if properties == 0 else 300
    props = ", ".join(f"'p{n:02d}', concat('v', cast(id as string))" for n in range(properties))
    topic = f"small{properties}"
    df = spark.range(0, rows, numPartitions=2).selectExpr(
        "cast(id as string) as body",
        f"map({props}) as properties" if properties else "map('id', 'x') as properties",
    )
    with broker.client() as client:
        before = client.stats()["send_requests"]
        df.write.format("equeue").options(**broker.options()).option("topic", topic).mode(
            "append"
        ).save()
        requests = client.stats()["send_requests"] - before
        queues = stored(client, topic)
    bodies = sorted(int(m.body) for msgs in queues.values() for m in msgs)
    assert bodies == list(range(rows))  # every row once
    for msgs in queues.values():
        for m in msgs:
            assert len(m.properties) == max(1, properties)
    least = rows // SMALL_BATCH if properties == 0 else rows // 35
    assert requests >= least


class _Attempt:
    """What TaskContext.get() gives a task: its partition, which attempt it is."""

    def __init__(self, number: int) -> None:
        self.number = number

    def partitionId(self) -> int:  # (pyspark's names)
        return 0

    def attemptNumber(self) -> int:
        return self.number


def test_a_retried_task_checks_every_row_before_it_sends_any(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row the sink's check refuses, in the third Arrow batch of a partition (reviewc
    F3): the first attempt sends the two batches before it; a retry sends nothing (before:
    the 2,000 rows again per attempt, spark.task.maxFailures copies). The control: a retry
    of good rows sends them all, read back from its spill."""
    import pyarrow as pa
    from pyspark import TaskContext
    from pyspark.sql.types import IntegerType, StringType, StructField, StructType

    from equeue.errors import QueueNotFoundError

    topic = "retried"
    with broker.client() as client:
        client.create_topic(topic, 4)
    schema = StructType([StructField("body", StringType()), StructField("queue_id", IntegerType())])
    writer = EqueueBrokerWriter({**broker.options(), "topic": topic}, schema, False)

    def batches(bad: bool) -> Iterator[pa.RecordBatch]:
        for low in (0, 1000, 2000):
            ids = [99 if bad and n == 2500 else n % 4 for n in range(low, low + 1000)]
            bodies = [str(n) for n in range(low, low + 1000)]
            yield pa.record_batch(
                [pa.array(bodies), pa.array(ids, pa.int32())], ["body", "queue_id"]
            )

    def count() -> int:
        with broker.client() as client:
            return sum(client.queue_range(topic, q)[1] for q in client.queue_ids(topic))

    for attempt, stored_after in ((0, 2000), (1, 2000), (3, 2000)):
        context = _Attempt(attempt)
        monkeypatch.setattr(TaskContext, "get", classmethod(lambda cls, c=context: c))
        with pytest.raises(QueueNotFoundError, match="queue_id 99") as caught:
            writer.write(batches(bad=True))
        assert count() == stored_after, f"attempt {attempt}"
        if attempt:
            assert "sent none" in "\n".join(caught.value.__notes__)
    monkeypatch.setattr(TaskContext, "get", classmethod(lambda cls: _Attempt(1)))
    sent = writer.write(batches(bad=False))
    assert sent.rows == 3000 and count() == 5000
    with broker.client() as client:
        bodies = sorted(int(m.body) for ms in stored(client, topic).values() for m in ms)
    assert bodies == sorted(list(range(2000)) + list(range(3000)))


def test_a_retried_task_refuses_a_row_past_the_broker_s_message_size_first(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reviewc F3, the broker's refusal: a body past the served store's max_message_size
    (now in the welcome) at row 2,500 of a retried task: refused with nothing sent (before:
    the 2,000 rows of the first two batches again per attempt, then the broker's
    MessageTooLargeError). The first attempt refuses that batch whole, before sending it."""
    import pyarrow as pa
    from pyspark import TaskContext
    from pyspark.sql.types import StringType, StructField, StructType

    from equeue.errors import MessageTooLargeError

    topic = "retried-large"
    with broker.client() as client:
        client.create_topic(topic, 2)
        assert client.welcome is not None
        largest = client.welcome.limits["max_message_size"]
    assert largest < FRAME  # the broker's store's: what one frame carries, here
    schema = StructType([StructField("body", StringType())])
    writer = EqueueBrokerWriter({**broker.options(), "topic": topic}, schema, False)

    def batches() -> Iterator[pa.RecordBatch]:
        for low in (0, 1000, 2000):
            bodies = ["x" * (largest + 1) if n == 2500 else str(n) for n in range(low, low + 1000)]
            yield pa.record_batch([pa.array(bodies)], ["body"])

    def count() -> int:
        with broker.client() as client:
            return sum(client.queue_range(topic, q)[1] for q in client.queue_ids(topic))

    for attempt in (0, 1, 2):
        context = _Attempt(attempt)
        monkeypatch.setattr(TaskContext, "get", classmethod(lambda cls, c=context: c))
        with pytest.raises(MessageTooLargeError, match=f"the limit is {largest}") as caught:
            writer.write(batches())
        assert count() == 2000, f"attempt {attempt}"
        assert f"broker's store's, from its welcome: max_message_size={largest}" in "\n".join(
            caught.value.__notes__
        )


def test_a_tls_broker_is_written_and_read_with_ca_file() -> None:
    """tls:// with a self-signed certificate: caFile names it on every node; without it
    the system's CAs refuse the broker, and the error says so."""
    import pyarrow as pa
    from pyspark.sql.types import StringType, StructField, StructType

    from equeue.server import BrokerThread

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a self-signed certificate")
    home = short_dir()
    try:
        cert, key = home / "cert.pem", home / "key.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
             "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        with BrokerThread(
            home / "s", listen=["tls://127.0.0.1:0"], tls_cert=str(cert), tls_key=str(key)
        ) as running:
            (url,) = running.urls
            given = {"broker": url, "caFile": str(cert), "topic": "tls"}
            schema = StructType([StructField("body", StringType())])
            writer = EqueueBrokerWriter(given, schema, False)
            batch = pa.record_batch([pa.array(["a", "b", "c"])], names=["body"])
            assert writer.write(iter([batch])).rows == 3
            options = StreamOptions({"broker": url, "caFile": str(cert), "topics": "tls"})
            with Client(url, cafile=str(cert)) as client:
                ranges = [(q, *client.queue_range("tls", q)) for q in client.queue_ids("tls")]
            bodies = [
                bytes(b)
                for q, first, end in ranges
                for part in read_range(options, QueueRange("tls", q, first, end))
                for b in part.column("body").to_pylist()
            ]
            assert sorted(bodies) == [b"a", b"b", b"c"]
            with pytest.raises(EQueueError, match="CERTIFICATE_VERIFY_FAILED"):
                EqueueBrokerWriter({"broker": url, "topic": "tls"}, schema, False)
            with pytest.raises(SparkOptionError, match="option caFile is for a tls:// broker"):
                EqueueBrokerWriter({**given, "broker": "unix:/x"}, schema, False)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_the_path_sink_on_a_served_store_names_the_broker_option(
    broker: Broker, spark: SparkSession
) -> None:
    df = spark.createDataFrame([("x",)], "body string")
    with pytest.raises(Exception) as caught:
        df.write.format("equeue").option("topic", "w").mode("append").save(str(broker.store))
    text = spark_error(caught)
    assert f"the store at {broker.store} is served by a broker" in text
    assert f'.option("broker", "{broker.url}")' in text
    assert not (broker.store / "incoming").exists()  # refused before any task staged rows


def test_a_wrong_token_is_the_authentication_error_in_the_spark_error(
    broker: Broker, spark: SparkSession, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    df = spark.createDataFrame([("x",)], "body string")
    with broker.client() as client:
        before = {
            t: [client.queue_range(t, q) for q in client.queue_ids(t)] for t in client.topics()
        }
    with pytest.raises(Exception) as caught:
        df.write.format("equeue").option("broker", broker.url).option(
            "tokenFile", str(wrong)
        ).option("topic", "w").mode("append").save()
    assert "equeue.errors.AuthenticationError" in spark_error(caught)
    with pytest.raises(Exception) as caught:
        spark.read.format("equeue").option("broker", broker.url).option(
            "topics", "w"
        ).load().collect()
    assert "AuthenticationError" in spark_error(caught)  # no token at all
    with broker.client() as client:
        after = {
            t: [client.queue_range(t, q) for q in client.queue_ids(t)] for t in client.topics()
        }
    assert after == before


def test_the_broker_options_are_checked_on_the_driver(broker: Broker, tmp_path: Path) -> None:
    from pyspark.sql.types import StringType, StructField, StructType

    schema = StructType([StructField("body", StringType())])
    given = {**broker.options(), "topic": "w"}

    def refused(options: dict[str, Any], *said: str) -> None:
        with pytest.raises(SparkOptionError) as caught:
            EqueueBrokerWriter(options, schema, False)
        for text in said:
            assert text in str(caught.value)

    refused({**given, "path": str(broker.store)}, "and the store path", "are exclusive")
    refused({**given, "broker": "http://x"}, "option broker='http://x'", "unix:PATH")
    refused(
        {**given, "broker": "tcp://127.0.0.1"},
        "option broker: broker url 'tcp://127.0.0.1': no port after the host",
    )
    refused({**given, "tokenFile": str(tmp_path / "none")}, "option tokenFile=", "cannot read it")
    refused({**given, "jobId": "j1"}, "option jobId is not taken through a broker")
    refused({**given, "topic": "a/b"}, "option topic='a/b'")
    refused(
        {"tokenFile": str(broker.token_file), "topic": "w", "path": "/x"},
        "option tokenFile is for a broker",
    )
    refused({**given, "colour": "red"}, "unknown option 'colour'")
    with pytest.raises(SparkOptionError, match="option tokenFile"):
        StreamOptions({"topics": "w", "broker": broker.url, "tokenFile": ""})
    assert EqueueBrokerWriter(given, schema, False).topic == "w"


def test_relative_token_and_ca_files_are_made_absolute_on_the_driver(
    broker: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An executor's working directory is not the driver's (reviewc F1): the writer
    pickled on the driver, with tokenFile and caFile relative to the driver's, connects
    from another directory; before, every task failed 'cannot read it on this node'."""
    import pickle

    from pyspark.sql.types import StringType, StructField, StructType

    from equeue.spark.viabroker import BrokerAddress

    driver, executor = tmp_path / "driver", tmp_path / "executor"
    driver.mkdir()
    executor.mkdir()
    shutil.copy(broker.token_file, driver / "token")
    (driver / "ca.pem").write_text("")
    monkeypatch.chdir(driver)
    schema = StructType([StructField("body", StringType())])
    writer = EqueueBrokerWriter(
        {**broker.options(), "tokenFile": "token", "topic": "w"}, schema, False
    )
    shipped = pickle.dumps(writer)
    address = BrokerAddress({"broker": "tls://h:1", "tokenFile": "token", "caFile": "ca.pem"})
    assert (address.token_file, address.ca_file) == (str(driver / "token"), str(driver / "ca.pem"))
    # A relative unix: socket path too (the broker's, as seen from the driver's directory).
    socket_dir = os.path.relpath(broker.store, driver)
    relative = {**broker.options(), "broker": f"unix:{socket_dir}/broker.sock"}
    relative_writer = EqueueBrokerWriter({**relative, "topic": "w"}, schema, False)
    assert relative_writer.address.url == f"unix:{broker.store}/broker.sock"
    assert BrokerAddress({"broker": "unix:///run/x.sock"}).url == "unix:/run/x.sock"
    shipped_relative = pickle.dumps(relative_writer)
    monkeypatch.chdir(executor)
    for pickled in (shipped, shipped_relative):
        with pickle.loads(pickled).address.connect() as client:
            assert isinstance(client.topics(), list)


def test_a_relative_unix_path_is_checked_as_it_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """review3 R4: the option's check parsed the relative form, and the absolute one,
    past sun_path's 107 bytes, failed at every connect instead of at the plan."""
    from equeue.spark.viabroker import BrokerAddress, broker_url

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.chdir(deep)
    with pytest.raises(SparkOptionError, match="made absolute") as refused:
        broker_url({"broker": "unix:s/broker.sock"})
    assert "107" in str(refused.value) and "option broker" in str(refused.value)
    with pytest.raises(SparkOptionError, match="made absolute"):
        BrokerAddress({"broker": "unix:s/broker.sock"})
    monkeypatch.chdir(tmp_path)  # the control: short enough from here
    assert broker_url({"broker": "unix:s/broker.sock"}) == f"unix:{tmp_path}/s/broker.sock"


def test_a_token_file_that_is_a_fifo_is_refused_at_once(broker: Broker, tmp_path: Path) -> None:
    """reviewc F4: open() of a FIFO waited for a writer for ever, on the driver, before
    any task; now it is refused as not a regular file (a directory too)."""
    import threading

    from equeue.spark.viabroker import BrokerAddress

    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def plan() -> None:
        try:
            BrokerAddress({"broker": broker.url, "tokenFile": str(fifo)})
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    planning = threading.Thread(target=plan, daemon=True)
    planning.start()
    planning.join(10)
    if planning.is_alive():  # let the open go (a writer comes), then fail
        with open(fifo, "wb") as writer:
            writer.write(TOKEN.encode())
        planning.join(10)
        pytest.fail("BrokerAddress waited on the FIFO token file")
    assert isinstance(outcome[0], SparkOptionError), outcome
    assert "is not a regular file" in str(outcome[0])
    with pytest.raises(SparkOptionError, match="is not a regular file"):
        BrokerAddress({"broker": broker.url, "tokenFile": str(tmp_path)})


def test_a_stream_planned_through_the_broker_reads_a_rotated_token() -> None:
    """reviewc F5: the broker restarted with a new token in the same tokenFile; the
    driver's cached client reconnected with the old one and the query failed with
    AuthenticationError at its next planning. Now it connects again, reading the file."""
    from test_spark_stream import stream_schema

    from equeue.spark.stream import EqueueStreamReader

    home = short_dir()
    first: Broker | None = None
    second: subprocess.Popen[bytes] | None = None
    try:
        first = Broker(home)
        with first.client() as client:
            client.create_topic("rotated", 1)
            client.send("rotated", b"a")
        reader = EqueueStreamReader({**first.options(), "topics": "rotated"}, stream_schema())
        assert reader._ranges() == {"rotated": {"0": (0, 1)}}
        first.stop()
        first.token_file.write_text("a-new-token\n")
        second = subprocess.Popen(
            [sys.executable, "-m", "equeue", "serve", str(first.store), "--quiet",
             "--token-file", str(first.token_file), "--max-frame-bytes", str(FRAME)],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        assert second.stdout is not None
        url = second.stdout.readline().decode().split()[-1]
        with Client(url, token="a-new-token") as client:
            client.send("rotated", b"b")
        assert reader._ranges() == {"rotated": {"0": (0, 2)}}
        reader.stop()
    finally:
        if second is not None:
            second.terminate()
            second.wait(20)
        if first is not None:
            first.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_an_aborted_write_logs_a_lower_bound_of_the_rows_stored(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """reviewc F7: Spark can run the abort before a finished task's count is recorded;
    the line says "at least" and how many tasks reported, not a count as a fact."""
    import logging

    from pyspark.sql.types import StringType, StructField, StructType

    from equeue.spark.brokersink import SentRows

    schema = StructType([StructField("body", StringType())])
    writer = EqueueBrokerWriter({**broker.options(), "topic": "w"}, schema, False)
    with caplog.at_level(logging.WARNING, logger="equeue.spark.brokersink"):
        writer.abort([SentRows(1000, 1), None])
    said = caplog.records[-1].getMessage()
    assert "write failed; at least 1000 rows are in topic 'w'" in said
    assert "(1 of 2 tasks reported their count;" in said


def test_connect_timeout_lets_a_stream_wait_for_a_broker_restarted_slowly() -> None:
    """reviewc F8: a broker away 7 s failed the query at its next planning (the client's
    connect_timeout, 5 s, could not be given through Spark); connectTimeout=30 waits."""
    import threading

    from test_spark_stream import stream_schema

    from equeue.spark.stream import EqueueStreamReader

    home = short_dir()
    first: Broker | None = None
    second: list[Broker] = []
    try:
        first = Broker(home)
        with first.client() as client:
            client.create_topic("slow", 1)
            client.send("slow", b"a")
        options = {**first.options(), "topics": "slow", "connectTimeout": "30", "timeout": "60"}
        reader = EqueueStreamReader(options, stream_schema())
        assert reader._ranges() == {"slow": {"0": (0, 1)}}
        first.stop()
        restart = threading.Timer(7.0, lambda: second.append(Broker(home)))
        restart.start()
        assert reader._ranges() == {"slow": {"0": (0, 1)}}  # waited for the second broker
        restart.join()
        reader.stop()
        for bad in ("0", "-1", "soon", "nan"):
            with pytest.raises(SparkOptionError, match=f"option connectTimeout='{bad}'"):
                EqueueStreamReader({**options, "connectTimeout": bad}, stream_schema())
        with pytest.raises(SparkOptionError, match="option timeout is for a broker"):
            StreamOptions({"path": "/x", "topics": "slow", "timeout": "5"})
    finally:
        for served in (*second, first):
            if served is not None:
                served.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_rows_of_multibyte_text_are_cut_by_their_utf8_bytes(broker: Broker) -> None:
    """reviewc F9: the budget counted characters; 2,000 rows of 1,000 4-byte characters of
    properties made a request of ~487 KB against a 256 KiB frame: FrameTooLargeError."""
    import pyarrow as pa
    from pyspark.sql.types import MapType, StringType, StructField, StructType

    topic = "multibyte"
    schema = StructType(
        [
            StructField("body", StringType()),
            StructField("properties", MapType(StringType(), StringType())),
        ]
    )
    writer = EqueueBrokerWriter({**broker.options(), "topic": topic}, schema, False)
    rows = 2000
    properties = pa.array([[("p", "\U0001f600" * 1000)]] * rows, pa.map_(pa.string(), pa.string()))
    batch = pa.record_batch(
        [pa.array([str(n) for n in range(rows)]), properties], ["body", "properties"]
    )
    sent = writer.write(iter([batch]))
    assert sent.rows == rows and sent.requests >= rows * 4000 // (FRAME // 2)
    with broker.client() as client:
        stored_rows = [m for ms in stored(client, topic).values() for m in ms]
    assert sorted(int(m.body) for m in stored_rows) == list(range(rows))
    assert {m.properties["p"] for m in stored_rows} == {"\U0001f600" * 1000}


def test_chunks_stay_within_the_budget() -> None:
    def message(size: int) -> OutgoingMessage:
        return OutgoingMessage(b"x" * size, "tag", "key", {"p": "v"}, 0, None)

    messages = [message(100 + i % 300) for i in range(1000)] + [message(5000), message(10)]
    runs = list(chunks(messages, 4096))
    assert [m for run in runs for m in run] == messages
    assert runs[-2:] == [[messages[-2]], [messages[-1]]]  # the big one alone
    for run in runs:
        cost = sum(64 + len(m.body) + 3 + 3 + 12 for m in run)
        assert len(run) == 1 or cost <= 4096


def test_chunks_stay_within_the_broker_s_object_count() -> None:
    """Every run holds no more msgpack objects than the broker counts in one request
    (bounded.message_objects of the client's wire maps), whatever fields a row has."""
    from equeue.client.args import outgoing
    from equeue.protocol.bounded import SEND_BATCH_OBJECTS, max_objects, message_objects

    props = {f"p{n}": "v" for n in range(40)}
    messages = [
        OutgoingMessage(b"b", "tag" if i % 2 else "", "k" if i % 3 else None,
                        props if i % 5 else None, i % 7, i % 4 if i % 11 else None)
        for i in range(2000)
    ]  # fmt: skip
    bound = max_objects(100)
    runs = list(chunks(messages, 1 << 30, 100, bound))
    assert [m for run in runs for m in run] == messages
    for run in runs:
        counted = SEND_BATCH_OBJECTS + sum(message_objects(outgoing(m, "t")) for m in run)
        assert len(run) <= 100 and counted <= bound
    assert max(len(run) for run in runs) < 100  # the objects, not the rows, cut these


def test_a_retried_tasks_rows_go_to_the_spark_local_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """review3 (noticed): the spill went to tempfile's directory, often a small /tmp or a
    tmpfs; Spark's workers name their own local directories, sized for spills."""
    from equeue.spark.brokersink import spill_root

    local = tmp_path / "spark-local"
    local.mkdir()
    monkeypatch.setenv("SPARK_LOCAL_DIRS", f"{tmp_path / 'gone'},{local}")
    assert spill_root() == str(local)  # the first that exists
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path / "gone"))
    assert spill_root() is None  # none exists: tempfile's
    monkeypatch.delenv("SPARK_LOCAL_DIRS")
    assert spill_root() is None


def test_a_stream_planned_through_the_broker_sees_a_topic_created_again() -> None:
    """reviewj F1 through the broker: deleted_topics (protocol version 5) says where the
    topic was last deleted, so a topic created again past the offsets read is data loss,
    not a continuation that skips the new topic's first messages."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable
    from test_spark_stream import stream_schema

    from equeue import MessageStore
    from equeue.spark.stream import DELETED, EqueueStreamReader

    home = short_dir()
    served: Broker | None = None
    try:
        served = Broker(home)
        with served.client() as client:
            client.create_topic("again", 1)
            client.send_batch("again", [b"old %d" % i for i in range(10)])
        options = {**served.options(), "topics": "again", "startingOffsets": "latest"}
        reader = EqueueStreamReader(options, stream_schema())
        begin = reader.initialOffset()
        assert begin == {"again": {"0": 10}, DELETED: {}}
        reader.stop()
        served.stop()
        with MessageStore.open(served.store) as store:  # the broker stopped: its writer
            store.delete_topic("again")
            store.create_topic("again", 1)
            for i in range(30):
                store.send("again", b"new %d" % i)
        served = Broker(home)
        reader = EqueueStreamReader({**options, **served.options()}, stream_schema())
        with pytest.raises(DataLossError, match="deleted and created again"):
            reader.latestOffset(begin, ReadAllAvailable())
        reader.stop()
    finally:
        if served is not None:
            served.stop()
        shutil.rmtree(home, ignore_errors=True)
